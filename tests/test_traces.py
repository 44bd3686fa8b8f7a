"""Trace readers (Mooncake and token-level, detected), their errors, and the generator."""
from __future__ import annotations

import json

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
