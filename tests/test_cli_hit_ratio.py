"""`kvtier bench hit-ratio` and `kvtier bench cluster` as a user runs them: every bad input
is one `kvtier: error:` line with the right exit code, one capacity rule for 150% and
1.5, and output a person can read (header, legend, best marker, bound) in 100 columns,
on a terminal and piped."""
from __future__ import annotations

import gzip
import json
import os
import pty
import re
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
