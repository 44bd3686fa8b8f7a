"""`kvtier bench hit-ratio` and `kvtier bench cluster` as a user runs them: every bad input
is one `kvtier: error:` line with the right exit code, one capacity rule for 150% and
1.5, and output a person can read (header, legend, best marker, bound) in 100 columns,
on a terminal and piped."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_one_line_error, run_kvtier
from kvtier.policies import DEFAULT_POLICY

SMALL = ("--sessions", "20")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _mooncake(path: Path, n: int = 40) -> Path:
    """A small Mooncake trace: shared root, 4 conversations that grow, partial last blocks."""
    lines = []
    nxt = 100
    convs: dict[int, list[int]] = {}
    for i in range(n):
        c = i % 4
        ids = convs.setdefault(c, [0])
        ids = ids + [nxt, nxt + 1]
        nxt += 2
        convs[c] = ids
        lines.append({"timestamp": i, "input_length": 512 * (len(ids) - 1) + 100, "output_length": 5,
                      "hash_ids": ids})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _rows(out: str) -> list[list[str]]:
    """Cells of every table row (the head first) in rich's box drawing."""
    rows = []
    for line in out.splitlines():
        if line[:1] in ("│", "┃"):
            rows.append([c.strip() for c in re.split("[│┃]", line.strip().strip("│┃"))])
    return rows


def _tty(*args: str, columns: int = 100) -> tuple[int, str]:
    """Run the CLI with stdout on a pseudo-terminal COLUMNS wide; (exit code, text without colours)."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "60"}
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *args], stdout=slave, stderr=subprocess.PIPE,
                         env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:       # the child closed the terminal
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    p.wait(timeout=300)
    return p.returncode, ANSI.sub("", b"".join(chunks).decode()).replace("\r", "")


def _width(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


# --- bad input: one line, a hint, the right exit code ---------------------------------------

def test_gzip_trace_is_read(tmp_path):
    plain = _mooncake(tmp_path / "t.jsonl")
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    a = run_kvtier("bench", "hit-ratio", str(plain), "--policy", "lru", "--capacity", "10%", "--json")
    b = run_kvtier("bench", "hit-ratio", str(gz), "--policy", "lru", "--capacity", "10%", "--json")
    assert a.returncode == b.returncode == 0, b.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)


@pytest.mark.parametrize("content, needle", [
    (bytes(range(256)) * 4, "binary data"),
    ('{"tokens": [1], "session": "café"}\n'.encode("latin-1"), "not UTF-8"),
    (gzip.compress(b'{"input_length": 1, "hash_ids": [0]}\n' * 50)[:40], "damaged gzip"),
], ids=["binary", "latin-1", "damaged-gzip"])
def test_binary_or_damaged_trace(tmp_path, content, needle):
    p = tmp_path / "t.jsonl"
    p.write_bytes(content)
    assert_one_line_error(run_kvtier("bench", "hit-ratio", str(p)), 2, needle, str(p))


def test_folder_as_trace(tmp_path):
    assert_one_line_error(run_kvtier("bench", "hit-ratio", str(tmp_path)), 2, "is a directory")


@pytest.mark.parametrize("args, needle", [
    (("--block-tokens", "0"), "--block-tokens"),
    (("--block-tokens", "-3"), "--block-tokens"),
    (("--sessions", "0"), "--sessions"),
    (("--sessions", "-2"), "--sessions"),
    (("--seed", "-1"), "--seed"),
    (("--capacity", "0"), "at least 1 block"),
    (("--capacity", "0%"), "positive"),
    (("--capacity=-5%",), "positive"),
    (("--capacity", "inf%"), "positive"),
    (("--capacity", "lots"), "cannot parse capacity"),
    (("--capacity", "64GiB"), "--layout"),
    (("--layout", "gpt-9"), "--layout"),
    (("--block-tokens", "9223372036854775808"), "from 1 to 1,048,576"),   # an OverflowError in the replay before
    (("--block-tokens", "1048577"), "1,048,576"),
    (("--policy", "lru+nopartial+nopartial"), "repeats +nopartial"),
])
def test_bad_options(args, needle):
    assert_one_line_error(run_kvtier("bench", "hit-ratio", *args, *SMALL), 2, needle)


@pytest.mark.parametrize("args, needle", [
    (("--nodes", "0"), "--nodes"),
    (("--nodes", "1000000"), "at most 4096"),          # minutes and gigabytes before the bound
    (("--block-tokens", "0"), "--block-tokens"),      # the trace options are hit-ratio's (shared code)
    (("--capacity", "0%"), "positive"),
    (("--capacity", "2%,5%"), "one per-node size"),
    (("--policy", "belady"), "belady"),
    (("--router", ","), "--router"),
    (("--block-tokens", "9223372036854775808"), "1,048,576"),
    (("--policy", "lru+nopartial+nopartial"), "repeats +nopartial"),
])
def test_cluster_bad_options(args, needle):
    assert_one_line_error(run_kvtier("bench", "cluster", *args, *SMALL), 2, needle)


def test_generator_options_without_the_generated_trace_are_usage_errors(tmp_path):
    """--seed and --sessions shape the generated trace only: with a TRACE and no --synthetic
    they were silently ignored."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"tokens": list(range(40))}) + "\n")
    assert_one_line_error(run_kvtier("bench", "hit-ratio", str(p), "--seed", "7", "--sessions", "3"), 2,
                          "--seed and --sessions shape the generated trace", "--synthetic")
    assert_one_line_error(run_kvtier("bench", "cluster", str(p), "--seed", "7"), 2, "--seed shapes")
    r = run_kvtier("bench", "hit-ratio", str(p), "--synthetic", "--seed", "7", *SMALL, "--block-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr


def test_block_tokens_zero_on_a_token_level_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"tokens": list(range(40))}) + "\n")
    assert_one_line_error(run_kvtier("bench", "hit-ratio", str(p), "--block-tokens", "0"), 2, "--block-tokens")
    # Every prompt shorter than a block: nothing to cache, and the message says what to change.
    assert_one_line_error(run_kvtier("bench", "hit-ratio", str(p), "--block-tokens", "64"), 2,
                          "smaller --block-tokens")


@pytest.mark.parametrize("plot, needle", [
    ("missing-folder/h.png", "does not exist"),
    (".", "is a folder"),
    ("h.txt", ".png"),
])
def test_bad_plot_path_fails_before_the_replay(tmp_path, plot, needle):
    target = str(tmp_path / plot)
    r = run_kvtier("bench", "hit-ratio", "--json", "--plot", target, *SMALL)
    assert_one_line_error(r, 2, "--plot", needle)
    assert r.stdout == ""                    # no replay ran (--json would have printed rows)


def test_an_empty_plot_name_is_refused():
    r = run_kvtier("bench", "hit-ratio", "--json", "--plot", "", *SMALL)
    assert_one_line_error(r, 2, "--plot needs a file name")
    assert r.stdout == ""


def test_bad_policy_names():
    assert_one_line_error(run_kvtier("bench", "hit-ratio", "--policy", "belady+nopartial", *SMALL), 2, "'belady'")
    assert_one_line_error(run_kvtier("bench", "hit-ratio", "--policy", "magic", *SMALL), 2, "unknown policy")


# --- one capacity rule --------------------------------------------------------------------------

def test_capacity_above_the_trace_is_an_infinite_cache(tmp_path):
    """150% and 1.5 follow one rule (the same cache), as does a block count far above the trace:
    each runs as exactly the unique blocks, flagged, with no giant allocation."""
    p = _mooncake(tmp_path / "t.jsonl")
    r = run_kvtier("bench", "hit-ratio", str(p), "--policy", "lru,belady",
                   "--capacity", "150%,1.5,999999999999,100%,50%", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    by = {(x["capacity"], x["policy"]): x for x in rows}
    full = by[("100%", "lru")]
    for cap in ("150%", "1.5", "999999999999"):
        for pol in ("lru", "belady"):
            x = by[(cap, pol)]
            assert x["capacity_clamped"] and x["capacity_blocks"] == full["capacity_blocks"]
            assert x["capacity_fraction"] == 1.0
            assert x["prefix_hit_ratio"] == by[("100%", pol)]["prefix_hit_ratio"]
    assert not full["capacity_clamped"] and not by[("50%", "lru")]["capacity_clamped"]
    # The table says so too.
    t = run_kvtier("bench", "hit-ratio", str(p), "--policy", "lru", "--capacity", "150%,1.5")
    assert t.returncode == 0 and "150%, 1.5: more than the trace's" in t.stdout and "infinite cache" in t.stdout


def test_cluster_capacity_above_the_trace(tmp_path):
    p = _mooncake(tmp_path / "t.jsonl")
    r = run_kvtier("bench", "cluster", str(p), "--nodes", "2", "--capacity", "1.5", "--router", "pooled", "--json")
    assert r.returncode == 0, r.stderr
    x = json.loads(r.stdout)
    assert x["capacity_clamped"] and x["capacity_blocks"] > 0


# --- output a newcomer can read, in 100 columns ------------------------------------------------------

def _check_report(out: str) -> None:
    assert out.startswith("Trace agentic-seed0: generated agentic trace")
    assert "unique blocks of 512 tokens" in out and "infinite cache" in out
    for word in ("How to read the table:", "prefix hit", "token hit", "% unique", "of bound", "belady"):
        assert word in out
    rows = _rows(out)
    head = rows[0]
    assert head[:4] == ["policy", "capacity", "blocks", "% unique"]
    col = {name: i for i, name in enumerate(head)}
    pol, cap, hit_at, bound_at = col["policy"], col["capacity"], col["prefix hit"], col["of bound"]
    assert "token hit" in col
    groups: dict[str, list[list[str]]] = {}
    for row in rows[1:]:
        groups.setdefault(row[cap], []).append(row)
    assert len(groups) == 5
    for cells in groups.values():
        hit = {c[pol]: float(c[hit_at].lstrip("* ")) for c in cells}
        bound = hit.pop("belady (bound)")
        assert {"lru", DEFAULT_POLICY, "arc"} <= set(hit)
        best = max(hit.values())
        starred = {c[pol] for c in cells if c[hit_at].startswith("*")}
        assert starred == {p for p, v in hit.items() if v == best}      # the best online policy, ties too
        assert bound >= best                                            # Belady is the bound
        for c in cells:
            if c[pol] != "belady (bound)":
                assert float(c[bound_at].rstrip("%")) == pytest.approx(100 * hit[c[pol]] / bound, abs=0.06)
    assert f"recommended = {DEFAULT_POLICY}" in out


def test_default_output_piped_fits_100_columns():
    r = run_kvtier("bench", "hit-ratio", *SMALL, env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    _check_report(r.stdout)
    assert _width(r.stdout) <= 100


def test_default_output_on_a_100_column_terminal():
    code, out = _tty("bench", "hit-ratio", *SMALL, "--layout", "kimi-k2")
    assert code == 0, out
    _check_report(out)
    assert "bytes" in _rows(out)[0] and "--layout" in out
    assert _width(out) <= 100
    assert "s3fifo+nopartial" in _tty("bench", "hit-ratio", *SMALL, "--policy", "all", "--capacity", "5%")[1]


def test_all_policies_fit_without_cutting_names():
    r = run_kvtier("bench", "hit-ratio", *SMALL, "--policy", "all", "--capacity", "1%,150%")
    assert r.returncode == 0, r.stderr
    assert _width(r.stdout) <= 100
    names = {row[0] for row in _rows(r.stdout)[1:]}        # the policy column, first
    assert {"s3fifo+nopartial", "reuse+nopartial", "belady (bound)"} <= names


def test_cluster_output_fits_100_columns():
    r = run_kvtier("bench", "cluster", *SMALL, "--nodes", "2")
    assert r.returncode == 0, r.stderr
    assert _width(r.stdout) <= 100 and "max/mean load" in r.stdout and "How to read the table:" in r.stdout
    code, out = _tty("bench", "cluster", *SMALL, "--nodes", "2")
    assert code == 0 and _width(out) <= 100
    routers = [row[1] for row in _rows(out)[1:]]
    assert "token-aware" in routers and "round-robin" in routers


def test_help_lists_policies_and_defaults():
    """Every option of both commands says its default, and the policies are listed."""
    from kvtier.cli import _DefaultsHelp, build_parser

    parser = build_parser()
    bench = next(a for a in parser._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "bench")
    for name in ("hit-ratio", "cluster"):
        sub = bench.choices[name]
        fmt = _DefaultsHelp(name)
        for a in sub._actions:
            if a.option_strings and a.nargs != 0 and a.dest not in ("help", "log_level"):
                assert "default" in fmt._get_help_string(a), (name, a.dest)
    text = run_kvtier("bench", "hit-ratio", "--help").stdout
    for word in ("lru", "lfu", "s3fifo", "arc", "reuse", "+nopartial", "belady", "recommended", "all"):
        assert word in text


def test_recommended_note_says_what_it_does_on_this_trace():
    """The note under a table compares the recommended policy with its base policy and with the
    best online policy shown, from the figures of that very table."""
    from kvtier.bench.hit_ratio_report import Row, notes
    from kvtier.sim.replay import replay
    from kvtier.traces.model import Request, Trace

    base = DEFAULT_POLICY.split("+")[0]
    reqs = [Request([0, 10 + i, 100 + i], 3 * 16, last_tokens=None) for i in range(6)] * 3
    full = Trace("full", reqs, 16, format="tokens")
    partial = Trace("partial", [Request(r.keys, 40, last_tokens=8) for r in reqs], 16)

    def rows(tr):
        return [Row("50%", 9, replay(tr, p, 9)) for p in (base, DEFAULT_POLICY, "arc")]

    text = " ".join(notes(full, rows(full)))
    assert f"recommended = {DEFAULT_POLICY}" in text
    if "+nopartial" in DEFAULT_POLICY:
        assert f"the same as {base} here" in text and "no partial last block" in text
        text = " ".join(notes(partial, rows(partial)))
        assert f"against {base} here" in text and "the same as" not in text
    assert "best online policy shown" in text
    assert "recommended" not in " ".join(notes(full, [Row("50%", 9, replay(full, "arc", 9))]))


# --- the trial of the trace side ----------------------------------------------------------------

def test_tables_are_never_cut_on_a_narrow_terminal():
    """At 60 columns rich cut cells ('lru+no…', '0.28…'): tables render at least 100 wide
    and the terminal wraps the lines, so every name and figure is whole."""
    code, out = _tty("bench", "hit-ratio", *SMALL, "--policy", "all", "--capacity", "5%", columns=60)
    assert code == 0, out
    assert "…" not in out
    rows = _rows(out)
    assert {"s3fifo+nopartial", "reuse+nopartial", "belady (bound)"} <= {r[0] for r in rows[1:]}
    hit = rows[0].index("prefix hit")
    assert all(re.fullmatch(r"(\* )?\d\.\d{4}", r[hit]) for r in rows[1:]), rows


@pytest.mark.parametrize("bench", ["hit-ratio", "cluster"])
def test_a_table_into_a_closed_pipe_exits_141(bench):
    """`kvtier bench hit-ratio | head -1` exited 1 (rich's own broken-pipe handler); kvtier's
    gives 141, as `--json | head -1` does, and says nothing. Stdout is block-buffered, as in a
    user's shell, so the table's flush is the first write that meets the closed pipe."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "bench", bench, *SMALL, "--policy", "lru"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()                  # the reader is gone before the table is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == "", err


def _two_traces(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    a = _mooncake(tmp_path / "d1" / "t.jsonl")
    b = _mooncake(tmp_path / "d2" / "t.jsonl", n=20)
    return a, b


def test_traces_that_share_a_name_get_distinct_names(tmp_path):
    """d1/t.jsonl and d2/t.jsonl were both 't' (one --plot panel, zig-zag lines, rows that
    could not be told apart); t.jsonl beside t.jsonl.gz too. One file given twice is
    replayed once."""
    a, b = _two_traces(tmp_path)
    gz = a.with_suffix(".jsonl.gz")
    gz.write_bytes(gzip.compress(a.read_bytes()))
    r = run_kvtier("bench", "hit-ratio", str(a), str(b), str(gz), str(a), "--policy", "lru",
                   "--capacity", "10%", "--json")
    assert r.returncode == 0, r.stderr
    names = [json.loads(x)["trace"] for x in r.stdout.splitlines()]
    assert names == ["d1/t.jsonl", "d2/t", "d1/t.jsonl.gz"]
    c = run_kvtier("bench", "cluster", str(a), str(b), "--router", "session", "--json")
    assert c.returncode == 0, c.stderr
    assert [json.loads(x)["trace"] for x in c.stdout.splitlines()] == ["d1/t", "d2/t"]


def test_plot_has_one_panel_per_trace_when_names_clash(tmp_path):
    pytest.importorskip("matplotlib")
    from kvtier.bench.hit_ratio import load_traces
    from kvtier.bench.hit_ratio_plot import figure
    from kvtier.sim.replay import replay

    a, b = _two_traces(tmp_path)
    args = argparse.Namespace(trace=[str(a), str(b), str(a)], synthetic=False, seed=None, sessions=None,
                              block_tokens=None, json=True)
    traces = load_traces(args)
    fig = figure([replay(tr, "lru", 8) for tr in traces])
    assert [ax.get_title() for ax in fig.axes] == ["d1/t", "d2/t"]


@pytest.mark.parametrize("bench", ["hit-ratio", "cluster"])
def test_a_dash_reads_the_trace_from_stdin(tmp_path, bench):
    p = _mooncake(tmp_path / "t.jsonl")
    args = ["bench", bench, "--json"] + (["--policy", "lru", "--capacity", "10%"] if bench == "hit-ratio"
                                         else ["--router", "session"])
    want = run_kvtier(*args, str(p))
    got = subprocess.run([sys.executable, "-m", "kvtier.cli", *args, "-"], input=p.read_text(),
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == want.returncode == 0, got.stderr
    rows = [json.loads(x) for x in got.stdout.splitlines()]
    assert [x["trace"] for x in rows] == ["stdin"]
    assert [{**x, "trace": "t"} for x in rows] == [json.loads(x) for x in want.stdout.splitlines()]
    empty = subprocess.run([sys.executable, "-m", "kvtier.cli", *args, "-"], input="", capture_output=True,
                           text=True, timeout=120)
    assert_one_line_error(empty, 2, "stdin: the trace has no requests")


def test_pgf_plot_is_refused_before_the_replay(tmp_path, monkeypatch):
    """.pgf passed the early check, then failed after the replay ('xelatex' not found)."""
    pytest.importorskip("matplotlib")
    from kvtier.bench.hit_ratio import check_plot_path
    from kvtier.errors import ConfigError

    monkeypatch.setenv("PATH", "")           # no TeX program to be found
    with pytest.raises(ConfigError, match=r"\.pgf \(it needs LaTeX.*\.png \(or .*\.pdf.*\.svg"):
        check_plot_path(str(tmp_path / "out.pgf"))
    check_plot_path(str(tmp_path / "out.svg"))
    if shutil.which("xelatex") is None:
        r = run_kvtier("bench", "hit-ratio", "--json", "--plot", str(tmp_path / "out.pgf"), *SMALL)
        assert_one_line_error(r, 2, "--plot", "needs LaTeX", ".png")
        assert r.stdout == ""


def test_repeated_capacities_are_one_row_and_one_session_is_singular(tmp_path):
    r = run_kvtier("bench", "hit-ratio", *SMALL, "--policy", "lru", "--capacity", "5%,5,,5, 5%,0.05", "--json")
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["capacity"] for x in r.stdout.splitlines()] == ["5%", "5", "0.05"]   # as written
    p = tmp_path / "one.jsonl"
    p.write_text("".join(json.dumps({"tokens": list(range(40 + i)), "session": "s"}) + "\n" for i in range(3)))
    r = run_kvtier("bench", "hit-ratio", str(p), "--block-tokens", "16", "--policy", "lru", "--capacity", "50%")
    assert r.returncode == 0, r.stderr
    assert "3 requests in 1 session;" in r.stdout


def test_cluster_legend_describes_the_routers_as_the_code_runs_them():
    from kvtier.bench.cluster import LEGEND
    from kvtier.router import rules
    from kvtier.sim.cluster import ROUTERS

    text = " ".join(LEGEND.split())
    assert rules.SGLANG_CACHE_THRESHOLD == 0.5 and "covers at least half the prompt" in text
    assert f"> {rules.SGLANG_ABS_GAP} tokens and > {rules.SGLANG_REL_GAP}x" in text
    for r in ROUTERS:
        assert f"{r}:" in text or f"{r}," in text, r


def test_trace_help_points_to_the_format_docs():
    text = " ".join(run_kvtier("bench", "hit-ratio", "--help").stdout.split())
    assert "docs/traces.md" in text and "'-' reads standard input" in text
    assert (Path(__file__).resolve().parents[1] / "docs" / "traces.md").is_file()


def test_the_legend_explains_only_what_the_table_shows(tmp_path):
    """With one online policy the table has no `*`, no belady row and no `of bound` column,
    yet the legend explained all three."""
    p = _mooncake(tmp_path / "t.jsonl")
    r = run_kvtier("bench", "hit-ratio", str(p), "--policy", "lru", "--capacity", "10%")
    assert r.returncode == 0, r.stderr
    legend = r.stdout[r.stdout.index("How to read the table:"):]
    assert "of bound" not in r.stdout and "belady" not in legend and "  *  " not in legend
    r = run_kvtier("bench", "hit-ratio", str(p), "--policy", "lru,arc,belady", "--capacity", "10%")
    legend = r.stdout[r.stdout.index("How to read the table:"):]
    assert r.returncode == 0 and "of bound" in legend and "belady" in legend and "  *  " in legend
