"""Trace readers (Mooncake and token-level, detected), their errors, and the generator."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import threading

import pytest

from kvtier.errors import ConfigError
from kvtier.traces import AgenticConfig, TraceError, detect_format, generate, read_trace, synthetic_trace, write_trace


def _write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(p)


def test_mooncake_read_and_partial_tail(tmp_path):
    p = _write(tmp_path, [{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
                          "", {"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [0, 2]}])
    assert detect_format(p) == "mooncake"
    tr = read_trace(p)
    assert tr.format == "mooncake" and tr.block_tokens == 512 and len(tr) == 2
    assert tr.requests[0].last_tokens == 1000 - 512      # partial last block
    assert tr.requests[1].last_tokens is None            # 1024 = two full blocks
    assert tr.unique_blocks == 3 and tr.block_refs == 4


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "not valid JSON"),
    ({"input_length": 600, "hash_ids": [0]}, "expected ceil"),
    ({"input_length": 10, "hash_ids": ["a"]}, "list of integer"),
    ({"input_length": -1, "hash_ids": []}, "non-negative"),
    ({"input_length": 600, "hash_ids": [0, -1]}, r"hash_ids\[1\] is -1: block ids are integers in \[0, 2\*\*63\)"),
    ({"input_length": 600, "hash_ids": [10**26, 2]}, r"hash_ids\[0\] is 100000000000000000000000000"),
    ({"input_length": 10}, "'hash_ids' is missing: a Mooncake record needs it$"),     # was "must be a list"
    ({"tokens": [1, 2, 3]}, "'hash_ids' is missing.*a token-level record: a trace is one format throughout"),
])
def test_mooncake_malformed_line_is_named(tmp_path, bad, msg):
    good = {"timestamp": 0, "input_length": 10, "hash_ids": [0]}
    p = _write(tmp_path, [good, good, bad])
    with pytest.raises(TraceError, match=msg) as e:
        read_trace(p)
    assert e.value.line == 3 and f"{p}:3" in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_unknown_format_missing_and_empty(tmp_path):
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(_write(tmp_path, [{"foo": 1}]))
    with pytest.raises(TraceError, match="no requests"):
        read_trace(_write(tmp_path, [""], "e.jsonl"))
    with pytest.raises(TraceError, match="no such trace"):
        read_trace(str(tmp_path / "missing.jsonl"))
    with pytest.raises(TraceError, match="512-token"):
        read_trace(_write(tmp_path, [{"input_length": 1, "hash_ids": [0]}], "m.jsonl"), block_tokens=16)


def test_token_level_keys_full_blocks_and_shared_prefixes(tmp_path):
    a = list(range(40))
    p = _write(tmp_path, [{"timestamp": 0, "tokens": a, "session": "x"},
                          {"timestamp": 1, "tokens": a[:16] + [99] * 30, "output_length": 3}])
    assert detect_format(p) == "tokens"
    tr = read_trace(p, block_tokens=16)
    r0, r1 = tr.requests
    assert len(r0.keys) == 2 and len(r1.keys) == 2      # 40 and 46 tokens: 2 full 16-token blocks
    assert r0.keys[0] == r1.keys[0] and r0.keys[1] != r1.keys[1]
    assert all(isinstance(k, bytes) and len(k) == 16 for k in r0.keys)
    assert r0.session == "x" and r1.session is None and tr.has_sessions
    with pytest.raises(TraceError, match="token ids") as e:
        read_trace(_write(tmp_path, [{"tokens": [1, 2]}, {"tokens": [1, -2]}], "b.jsonl"))
    assert e.value.line == 2


SMALL = AgenticConfig(seed=3, sessions=12, block_tokens=64)


def test_generator_is_deterministic_and_seeded():
    a, b = synthetic_trace(SMALL), synthetic_trace(SMALL)
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    assert [r.timestamp for r in a.requests] == [r.timestamp for r in b.requests]
    c = synthetic_trace(AgenticConfig(seed=4, sessions=12, block_tokens=64))
    assert [r.keys for r in a.requests] != [r.keys for r in c.requests]


def test_generator_is_agentic():
    reqs = generate(SMALL)
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r.tokens)
    assert len(by_session) > 1
    for turns in by_session.values():        # each turn's prompt extends the previous one
        for prev, cur in zip(turns, turns[1:]):
            assert len(cur) > len(prev) and (cur[:len(prev)] == prev).all()
    firsts = [t[0][:200].tobytes() for t in by_session.values()]
    assert len(set(firsts)) < len(firsts)    # shared system prompts across sessions


def test_written_traces_read_back(tmp_path):
    p = str(tmp_path / "tok.jsonl")
    n = write_trace(p, SMALL, "tokens")
    tr = read_trace(p, block_tokens=64)
    assert len(tr) == n
    assert [r.keys for r in tr.requests] == [r.keys for r in synthetic_trace(SMALL).requests]
    q = str(tmp_path / "mc.jsonl")
    write_trace(q, AgenticConfig(seed=3, sessions=12, block_tokens=512), "mooncake")
    mc = read_trace(q)
    assert mc.format == "mooncake" and len(mc) == n and mc.has_sessions
    assert any(r.last_tokens for r in mc.requests)
    with pytest.raises(ConfigError):
        write_trace(p, SMALL, "csv")


def test_gzip_traces_read_like_plain_ones(tmp_path):
    import gzip
    lines = [{"timestamp": 0, "input_length": 1000, "hash_ids": [0, 1]}, {"timestamp": 1, "input_length": 600,
                                                                            "hash_ids": [0, 2]}]
    plain = _write(tmp_path, lines)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(open(plain, "rb").read()))
    a, b = read_trace(plain), read_trace(str(gz))
    assert b.name == "t" and b.format == "mooncake"
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]


def test_binary_damaged_and_folder_traces_are_trace_errors(tmp_path):
    import gzip
    p = tmp_path / "b.jsonl"
    p.write_bytes(b'{"tokens": [1]}\n' + bytes(range(256)))
    with pytest.raises(TraceError, match="binary data") as e:
        read_trace(str(p))
    assert e.value.line == 2
    p.write_bytes('{"tokens": [1], "session": "é"}\n'.encode("latin-1"))
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(str(p))
    p.write_bytes(gzip.compress(b'{"tokens": [1]}\n' * 100)[:30])
    with pytest.raises(TraceError, match="damaged gzip"):
        read_trace(str(p))
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(str(tmp_path))
    with pytest.raises(TraceError, match="at least 1"):
        read_trace(_write(tmp_path, [{"tokens": [1, 2]}], "z.jsonl"), block_tokens=0)


def test_trace_statistics():
    from kvtier.traces.model import Request, Trace
    tr = Trace("t", [Request([1, 2], 20, session="a", last_tokens=4), Request([1, 2, 3], 40, session="a"),
                     Request([1, 4], 30, session="b")], 16)
    assert tr.sessions == 2 and tr.has_partial_blocks
    assert tr.infinite_hits == 0 + 2 + 1
    assert tr.requests[0].hit_tokens(2, 16) == 20          # 16 + the 4-token partial block
    assert tr.requests[1].hit_tokens(3, 16) == 40 and tr.requests[1].hit_tokens(1, 16) == 16
    # A token-level request keys full blocks only: its uncached tail is never a hit.
    assert Request([7], 20).hit_tokens(1, 16) == 16 and Request([], 10).hit_tokens(0, 16) == 0


# --- numbers Python's json reads but a trace cannot use: NaN, infinities, huge integers ------

HUGE_INT = "9" * 400          # an int that parses but has no float (past 1.8e308)
MC = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
TOK = '{"timestamp": 0, "tokens": [1, 2], "output_length": 1}'


NON_FINITE = [(fmt, field, value) for fmt, field, values in [
    ("mooncake", "input_length", ["NaN", "Infinity", "-Infinity", "1e400", HUGE_INT]),
    ("mooncake", "output_length", ["NaN", "1e400"]),
    ("mooncake", "timestamp", ["NaN", "Infinity", HUGE_INT]),
    ("tokens", "output_length", ["1e400", "NaN", HUGE_INT]),
    ("tokens", "timestamp", ["NaN", "Infinity", "1e400", HUGE_INT]),
] for value in values]


@pytest.mark.parametrize("fmt, field, value", NON_FINITE,
                         ids=[f"{f}-{n}-{'400digits' if v == HUGE_INT else v}" for f, n, v in NON_FINITE])
def test_non_finite_numbers_are_named_trace_errors(tmp_path, fmt, field, value):
    good = MC if fmt == "mooncake" else TOK
    bad = re.sub(f'"{field}": [0-9]+', f'"{field}": {value}', good)
    assert bad != good
    p = _write(tmp_path, [good, bad])
    with pytest.raises(TraceError, match="must be a finite, non-negative number") as e:
        read_trace(p)
    assert e.value.line == 2 and str(e.value).startswith(f"{p}:2: field '")
    assert HUGE_INT not in str(e.value)        # a 400-digit value is described, not printed


def test_finite_numbers_still_read(tmp_path):
    p = _write(tmp_path, [MC.replace('"timestamp": 0', '"timestamp": 1e300')])
    assert read_trace(p).requests[0].timestamp == 1e300
    q = _write(tmp_path, [TOK.replace('"output_length": 1', '"output_length": 2.0')], "q.jsonl")
    assert read_trace(q).requests[0].output_length == 2


@pytest.mark.parametrize("fmt, field", [("mooncake", "input_length"), ("mooncake", "output_length"),
                                        ("tokens", "output_length")])
def test_lengths_past_any_context_are_named_not_printed(tmp_path, fmt, field):
    good = MC if fmt == "mooncake" else TOK
    p = _write(tmp_path, [good, re.sub(f'"{field}": [0-9]+', f'"{field}": 1e300', good)])
    with pytest.raises(TraceError, match=f"'{field}' is 1e\\+300 tokens, more than") as e:
        read_trace(p)
    assert e.value.line == 2 and len(str(e.value)) - len(str(p)) < 150   # the path's length varies
    q = _write(tmp_path, [re.sub(f'"{field}": [0-9]+', f'"{field}": {2**31}', good)], "q.jsonl")
    if field == "output_length":     # the bound itself still reads
        assert read_trace(q).requests[0].output_length == 2**31


def test_a_byte_order_mark_is_skipped_and_a_pipe_is_named(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (MC + "\n" + MC + "\n").encode())
    t = read_trace(str(p))
    assert len(t) == 2 and t.name == "bom" and t.format == "mooncake"
    from kvtier.traces.read import trace_name
    assert trace_name("/dev/fd/63") == "pipe-63" and trace_name("/proc/self/fd/5") == "pipe-5"
    assert trace_name("/data/63.jsonl") == "63"


@pytest.mark.parametrize("bad, msg", [
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="deep-line"),
    pytest.param('{"timestamp": 0, "input_length": 10, "hash_ids": [0], "session": ' + "[" * 100_000
                 + "]" * 100_000 + "}", "nested too deeply", id="deep-field"),
    pytest.param('{"timestamp": 0, "input_length": 10, "hash_ids": [' + "9" * 5000 + "]}", "more than",
                 id="5000-digit-id"),
    # nested, but within json's limit: parses, so the message must describe it, not repr() it
    pytest.param('{"timestamp": 0, "input_length": ' + "[" * 600 + "]" * 600 + ', "hash_ids": []}',
                 "got a JSON array", id="deep-length"),
    pytest.param('{"timestamp": 0, "input_length": 10, "hash_ids": [0], "session": ' + "[" * 600 + "]" * 600
                 + "}", "'session' must be a string or an integer", id="deep-session"),
    pytest.param('{"timestamp": 0, "input_length": 10, "hash_ids": [0], "session": "\\ud800"}',
                 "not valid Unicode", id="surrogate-session"),
    pytest.param('{"tokens": [1], "session": {"a": 1}}', "'session' must be a string or an integer",
                 id="object-session"),
])
def test_deep_nesting_huge_integers_and_bad_sessions_are_named(tmp_path, bad, msg):
    first = TOK if '"tokens"' in bad else MC
    p = _write(tmp_path, [first, "", bad])
    with pytest.raises(TraceError, match=msg) as e:
        read_trace(p)
    assert e.value.line == 3 and f"{p}:3: " in str(e.value)


def test_integer_sessions_are_kept_as_text(tmp_path):
    tr = read_trace(_write(tmp_path, [MC.replace('"hash_ids"', '"session": 7, "hash_ids"')]))
    assert tr.requests[0].session == "7"


@pytest.mark.parametrize("field", ["input_length", "timestamp"])
@pytest.mark.parametrize("bench", ["hit-ratio", "cluster"])
def test_cli_non_finite_and_nested_traces_exit_2(tmp_path, bench, field):
    from conftest import assert_one_line_error, run_kvtier
    p = _write(tmp_path, [MC, MC.replace(f'"{field}": ', f'"{field}": NaN, "x": ')])
    assert_one_line_error(run_kvtier("bench", bench, p), 2, f"{p}:2: field '{field}'", "finite")
    q = _write(tmp_path, [MC, "[" * 100_000 + "]" * 100_000], "deep.jsonl")
    assert_one_line_error(run_kvtier("bench", bench, q), 2, f"{q}:2: ", "nested too deeply")


# --- inputs that are not regular files: pipes, FIFOs, devices -------------------------------

@pytest.fixture
def fifo(tmp_path):
    """make(chunks) -> (path of a named FIFO, its writer thread), as `<(cat t.jsonl)` or
    `mkfifo` gives kvtier a trace. The writer stops quietly when the reader goes away; once
    done it answers every later open with an empty stream, as a spent pipe does, so a reader
    that opens the input twice fails instead of hanging."""
    import errno
    import os
    import threading
    import time
    stop = threading.Event()
    threads = []

    def make(chunks, name="pipe.jsonl"):
        path = tmp_path / name
        os.mkfifo(path)

        def write():
            try:
                with open(path, "wb") as f:
                    for c in chunks:
                        if stop.is_set():
                            return
                        f.write(c)
            except BrokenPipeError:
                pass
            while not stop.is_set():          # later opens: EOF at once
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError as e:
                    if e.errno != errno.ENXIO:    # ENXIO: no reader yet
                        raise
                time.sleep(0.02)

        t = threading.Thread(target=write, daemon=True)
        t.start()
        threads.append(t)
        return str(path), t

    yield make
    stop.set()
    for t in threads:
        t.join(5)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_fifo_trace_reads_like_a_file(tmp_path, fifo, compress):
    import gzip
    q = str(tmp_path / "mc.jsonl")
    write_trace(q, AgenticConfig(seed=3, sessions=12, block_tokens=512), "mooncake")
    data = open(q, "rb").read()
    if compress:
        data = gzip.compress(data)
    # the gzip magic split over two writes, then the rest in pieces: nothing may be lost
    p, _ = fifo([data[:1], data[1:1000], data[1000:]])
    a, b = read_trace(q), read_trace(p)
    assert b.format == "mooncake" and len(b) == len(a) > 0
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    assert [r.session for r in a.requests] == [r.session for r in b.requests]


def test_fifo_token_trace_with_bad_line_is_named(fifo):
    p, _ = fifo([(TOK + "\n" + TOK.replace("0", "NaN", 1) + "\n").encode()])
    with pytest.raises(TraceError, match="'timestamp' must be a finite") as e:
        read_trace(p, block_tokens=1)
    assert e.value.line == 2


def test_endless_input_without_line_ends_is_an_error_not_a_hang(fifo, monkeypatch):
    import itertools
    from kvtier.traces import read
    monkeypatch.setattr(read, "MAX_LINE_BYTES", 1 << 16)
    p, _ = fifo(itertools.repeat(b"a" * 4096))     # never ends, never a newline
    with pytest.raises(TraceError, match="no line end") as e:
        read_trace(p)
    assert e.value.line == 1
    with pytest.raises(TraceError, match="binary data") as e:
        read_trace("/dev/zero")              # a device: read with the same bound
    assert e.value.line == 1


def test_non_regular_paths_that_are_not_traces(tmp_path):
    import socket
    with pytest.raises(TraceError, match="is a directory"):
        read_trace(str(tmp_path))
    with pytest.raises(TraceError, match="no requests"):
        read_trace("/dev/null")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "sock"))
        with pytest.raises(TraceError, match="cannot open the trace"):
            read_trace(str(tmp_path / "sock"))
    finally:
        s.close()


def test_cli_reads_a_fifo(tmp_path, fifo):
    from conftest import run_kvtier
    q = str(tmp_path / "mc.jsonl")
    write_trace(q, AgenticConfig(seed=3, sessions=12, block_tokens=512), "mooncake")
    p, _ = fifo([open(q, "rb").read()])
    args = ("bench", "hit-ratio", "--policy", "lru", "--capacity", "10%", "--json")
    a, b = run_kvtier(*args, q, timeout=120), run_kvtier(*args, p, timeout=120)
    assert a.returncode == b.returncode == 0, b.stderr
    name = lambda out: [{**json.loads(ln), "trace": None} for ln in out.splitlines()]  # noqa: E731
    assert name(a.stdout) == name(b.stdout)


def test_the_generator_command_writes_traces_the_reader_takes(tmp_path):
    """`python -m kvtier.traces.synthetic`: no runpy warning, a Mooncake trace the reader
    reads back (its --block-tokens wrote traces the reader refused; the option is gone), and
    a path it cannot write is one `kvtier: error:` line, not a traceback."""
    import subprocess
    import sys

    from kvtier.bench.common import child_env

    def gen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvtier.traces.synthetic", *args], capture_output=True,
                              text=True, env=child_env(), timeout=120)

    r = gen("--format", "mooncake", "--sessions", "3", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr   # one line, no warning
    assert read_trace(str(tmp_path / "m.jsonl")).format == "mooncake"
    r = gen(str(tmp_path))
    assert r.returncode == 1 and r.stderr.strip() == f"kvtier: error: cannot write {tmp_path}: Is a directory"
    assert gen("--block-tokens", "16", str(tmp_path / "x.jsonl")).returncode == 2


def _generator(*args: str, **kw) -> subprocess.Popen:
    import sys

    from kvtier.bench.common import child_env
    return subprocess.Popen([sys.executable, "-m", "kvtier.traces.synthetic", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), **kw)


def test_the_generator_command_errors_are_one_line_and_leave_no_file(tmp_path):
    """--sessions past memory printed a traceback ending in ConfigError; a bad option printed
    argparse's usage. Both are one `kvtier: error:` line, exit 2, and nothing is written."""
    for args, needle in ((["--sessions", "100000000"], "fewer sessions"), (["--sessions", "0"], "--sessions")):
        p = _generator(*args, str(tmp_path / "x.jsonl"))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 2, err
        assert err.startswith("kvtier: error: ") and err.count("\n") == 1 and needle in err, err
        assert "Traceback" not in err
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupted_generator_leaves_no_partial_trace(tmp_path, signame):
    """Ctrl-C printed a KeyboardInterrupt traceback and left a partial file that replayed as a
    shorter trace; now: `kvtier: interrupted`, exit 130, and no file (the trace is written
    beside its name and renamed only when complete). SIGTERM (`kill`, `timeout`) left the
    partial file: it stops the generator as Ctrl-C does."""
    import signal
    import time

    p = _generator(str(tmp_path / "out.jsonl"))          # the default: ~180 MB, seconds to write
    deadline = time.monotonic() + 30
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    time.sleep(0.2)                                    # into the generation, past the file's creation
    [part] = list(tmp_path.iterdir())
    assert part.name.startswith(".out.jsonl.") and part.name.endswith(".part")
    p.send_signal(getattr(signal, signame))
    out, err = p.communicate(timeout=60)
    assert (p.returncode, err) == (130, "kvtier: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_the_generator_writes_to_stdout_and_explains_its_options(tmp_path):
    from kvtier.traces.synthetic import _parser

    p = _generator("--format", "mooncake", "--sessions", "3", "-", cwd=str(tmp_path))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert err == f"wrote {len(out.splitlines())} requests to stdout\n"
    assert all("hash_ids" in json.loads(x) for x in out.splitlines())
    assert not (tmp_path / "-").exists()
    helps = {a.dest: a.help for a in _parser()._actions}
    for dest in ("format", "seed", "sessions"):
        assert helps[dest], dest
    assert "180 MB" in helps["format"] and "0.4 MB" in helps["format"]


def test_names_of_one_runs_traces_are_distinct(tmp_path):
    """Two traces named alike ('d1/t.jsonl', 'd2/t.jsonl'; 't.jsonl' beside 't.jsonl.gz') got
    one name, so --plot merged them into one panel and --json rows could not be told apart."""
    from kvtier.traces.read import distinct_inputs, trace_names

    assert trace_names(["a/t.jsonl", "b/x.jsonl"]) == ["t", "x"]                     # no clash: as before
    assert trace_names(["d1/t.jsonl", "d2/t.jsonl.gz"]) == ["d1/t", "d2/t"]
    assert trace_names(["d/t.jsonl", "d/t.jsonl.gz"]) == ["d/t.jsonl", "d/t.jsonl.gz"]
    assert trace_names(["/a/d/t.jsonl", "/b/d/t.jsonl"]) == ["d/t.jsonl", "d/t.jsonl#2"]
    assert trace_names(["d/agentic-seed0.jsonl"], taken=["agentic-seed0"]) == ["d/agentic-seed0"]
    assert trace_names(["-", "/dev/fd/63"]) == ["stdin", "pipe-63"]
    t = tmp_path / "t.jsonl"
    t.write_text(MC + "\n")
    (tmp_path / "link.jsonl").symlink_to(t)
    same = [str(t), str(tmp_path / "." / "t.jsonl"), str(tmp_path / "link.jsonl")]
    assert distinct_inputs([*same, "missing.jsonl", "missing.jsonl"]) == [str(t), "missing.jsonl"]


def test_the_generator_writes_into_a_pipe_and_through_a_link_never_replacing_them(tmp_path):
    """The trace went to a temporary file renamed onto the path, whatever the path was: a
    device (as root, `... /dev/null` replaced the machine's /dev/null with a file), a named
    pipe (replaced; its reader got nothing) or a symbolic link (replaced by a file, its
    target left as it was)."""
    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    n = write_trace(str(link), SMALL, "tokens")
    assert link.is_symlink() and len(read_trace(str(target), block_tokens=64)) == n

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    assert write_trace(str(pipe), SMALL, "tokens") == n
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)
    assert got and got[0] == target.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "pipe", "target.jsonl"]   # no temporary left
