"""`kvtier bench tiers|transport|engine|lookup`, `kvtier demo` and `kvtier generate` as a user
runs them: one-line errors for bad options, tables that fit 100 columns, progress on a
terminal only, and JSON output that is only JSON."""
from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error, run_kvtier as kvtier

# Far beyond any machine's memory: must fail at once with one line, never try to allocate.
HUGE = str(2**50)

def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


USAGE_ERRORS = [
    # bench tiers
    (["bench", "tiers", "--block-bytes", "0"], ["--block-bytes"]),
    (["bench", "tiers", "--block-bytes", "64KiB,,1MiB"], ["--block-bytes"]),
    (["bench", "tiers", "--block-bytes", "33"], ["--block-bytes", "multiple of 32"]),
    (["bench", "tiers", "--total", "0"], ["--total"]),
    (["bench", "tiers", "--block-bytes", "64KiB", "--total", "1KiB"], ["--total", "smaller than one block"]),
    (["bench", "tiers", "--repeat", "0"], ["--repeat", ">= 1"]),
    (["bench", "tiers", "--io-threads", "0"], ["--io-threads"]),
    (["bench", "tiers", "--tier", "disk", "--path", "/nonexistent/kvtier-test"],
     ["--path", "does not exist", "existing directory"]),
    (["bench", "tiers", "--io-threads", "8"], ["--io-threads", "--tier disk"]),
    (["bench", "tiers", "--tier", "disk", "--path", "/proc"], ["--path /proc", "not on a disk"]),   # was ENOENT
    (["bench", "engine", "--tiers", "disk", "--disk", "/proc"], ["--disk /proc", "not on a disk"]),
    # bench adapter
    (["bench", "adapter", "--disk", "/proc"], ["--disk /proc", "not on a disk"]),
    (["bench", "adapter", "--disk", "/nonexistent/kvtier-test"], ["--disk", "does not exist"]),
    (["bench", "adapter", "--requests", "100000000"], ["--requests", "memory available"]),
    (["bench", "adapter", "--layers", "100000", "--requests", "1000"], ["--layers", "memory available"]),
    (["bench", "serve", "--model", "no-such-model", "--modes", "none"], ["kvtier serve: --model 'no-such-model'"]),
    (["bench", "serve", "--route", "request"], ["--route and --no-links are for --servers 2"]),
    # options of another command or mode
    (["bench", "disagg", "--servers", "2"], ["--servers", "kvtier bench disagg --help"]),
    (["demo", "--bogus"], ["--bogus", "kvtier demo --help"]),
    (["bench", "tiers", "--path", "/tmp"], ["--path", "--tier disk"]),
    (["bench", "tiers", "--tier", "device", "--block-bytes", "100"], ["--block-bytes", "multiple of 256"]),
    (["bench", "tiers", "--tier", "device", "--repeat", "0"], ["--repeat"]),
    # bench transport
    (["bench", "transport", "--block-bytes", "0"], ["--block-bytes"]),
    (["bench", "transport", "--block-bytes", "100"], ["--block-bytes", "multiple of 32"]),
    (["bench", "transport", "--block-bytes", "1MiB", "--total", "1KiB"], ["--total", "smaller than one block"]),
    (["bench", "transport", "--repeat", "0"], ["--repeat"]),
    # bench lookup
    (["bench", "lookup", "--tokens", "0"], ["--tokens"]),
    (["bench", "lookup", "--tokens", "10", "--block-tokens", "16"], ["--tokens", "one block"]),
    (["bench", "lookup", "--block-tokens", "0"], ["--block-tokens"]),
    (["bench", "lookup", "--repeat", "0"], ["--repeat"]),
    (["bench", "lookup", "--hash", "md5"], ["--hash", "xxh3"]),
    # bench engine
    (["bench", "engine", "--block-tokens", "0"], ["--block-tokens"]),
    (["bench", "engine", "--prompt-tokens", "0"], ["--prompt-tokens"]),
    (["bench", "engine", "--prompt-tokens", "20"], ["--prompt-tokens", "two blocks"]),
    (["bench", "engine", "--prompt-tokens", "9000"], ["--prompt-tokens", "8192 positions"]),
    (["bench", "engine", "--repeat", "0"], ["--repeat"]),
    (["bench", "engine", "--decode-tokens", "1"], ["--decode-tokens", "at least 2"]),
    (["bench", "engine", "--batch", "0"], ["--batch"]),
    (["bench", "engine", "--batch", "1,x"], ["--batch"]),
    (["bench", "engine", "--batch", "1,100000"], ["--batch", "1024"]),
    (["bench", "engine", "--tiers", "device,gpu"], ["--tiers", "device, host, disk"]),
    (["bench", "engine", "--preset", "nope"], ["--preset", "kimi-tiny"]),
    (["bench", "engine", "--dtype", "int7"], ["--dtype", "float32"]),
    (["bench", "engine", "--disk", "/nonexistent/kvtier-test"], ["--disk", "does not exist"]),
    (["bench", "engine", "--spec-prompts", "tool"], ["--spec-prompts", "--speculative"]),
    (["bench", "engine", "--vllm-python", "/usr/bin/python3"], ["--vllm-python", "--compare-vllm"]),
    (["bench", "engine", "--rounds", "2"], ["--rounds", "--compare-vllm"]),
    (["bench", "engine", "--compare-vllm", "--vllm-python", "/nonexistent/python"],
     ["--vllm-python", "no executable file"]),
    # demo
    (["demo", "--block-tokens", "0"], ["--block-tokens"]),
    (["demo", "--sessions", "0"], ["--sessions"]),
    (["demo", "--sessions", "1000000000"], ["--sessions", "memory"]),     # refused before building them
    (["bench", "hit-ratio", "--sessions", "1000000000"], ["fewer sessions", "memory"]),
    (["demo", "--turns", "-1"], ["--turns"]),
    (["demo", "--seed", "-1"], ["--seed"]),
    (["demo", "--capacity", "0"], ["--capacity"]),
    (["demo", "--capacity", "1KiB"], ["--capacity", "smaller than one block"]),
    (["demo", "--capacity", "50MiB"], ["--capacity", "too small", "turn 1"]),
    # generate
    (["generate", "--prompt", "hi", "--max-tokens", "0"], ["--max-tokens"]),
    (["generate", "--prompt", "hi", "--block-tokens", "0"], ["--block-tokens"]),
    (["generate", "--prompt", "hi", "--temperature", "-1"], ["--temperature"]),
    (["generate", "--prompt", "hi", "--top-p", "0"], ["--top-p"]),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], ["--top-p"]),
    (["generate", "--prompt", "hi", "--seed", "-1"], ["--seed"]),
    (["generate", "--prompt", "hi", "--weights-seed", "-1"], ["--weights-seed"]),
    (["generate", "--prompt", "hi", "--weights-seed", str(2**64)], ["--weights-seed", "a seed"]),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], ["--seed", "a seed"]),
    (["generate", "--prompt", "hi", "--dtype", "int7"], ["--dtype", "float32"]),
    (["generate", "--prompt", "hi", "--preset", "gpt"], ["--preset", "kimi-tiny"]),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/kvtier-test"], ["--model", "does not exist"]),
    (["generate", "--prompt", "hi", "--kv-cache", "1KiB"], ["--kv-cache", "smaller than one KV block"]),
    (["generate", "--prompt", "hi", "--host-cache", "1KiB"], ["--host-cache", "smaller than one KV block"]),
    (["generate", "--prompt", "hi", "--disk", "/nonexistent/kvtier-test", "--disk-cache", "1KiB"],
     ["--disk-cache", "smaller than one KV block"]),
    (["generate", "--prompt", "hi", "--session", ""], ["--session"]),
    (["generate", "--prompt", "hi", "--top-p", "0.5"], ["--top-p shapes sampling", "--temperature"]),   # was ignored
    (["generate", "--prompt", "hi", "--top-p", "0.5", "--seed", "3"], ["--top-p and --seed shape sampling"]),
    (["generate", "--prompt", "hi", "--seed", "3", "--temperature", "1e-6"], ["--seed shapes sampling"]),  # greedy too
    (["generate"], ["--prompt"]),
    (["generate", "--prompt-ids", "1,abc,3"], ["--prompt-ids", "'abc'"]),
    (["generate", "--prompt", "hi", "--max-tokens", "100000"], ["--max-tokens 100000", "8192 positions"]),  # after
    (["generate", "--prompt-ids", "999999"], ["token ids must be ints in [0, 512)"]),                # the model loaded
    (["generate", "--prompt-ids", "1,2", "--max-tokens", "8191"], ["prompt (2 tokens) + max_tokens (8191)"]),
    (["generate", "--prompt", "hi", "--device", "cuda:0" if not _cuda() else "cuda:99"], ["cuda"]),
]


@pytest.mark.parametrize("args,needles", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_bad_option_is_one_usage_error(args, needles):
    r = kvtier(*args, timeout=120)
    assert_one_line_error(r, 2, *needles)
    if "turn 1" not in needles:              # found before any work, so nothing was printed
        assert r.stdout == ""


@pytest.mark.parametrize("args", [["demo", "--capacity", HUGE],
                                  ["generate", "--prompt", "hi", "--host-cache", HUGE],
                                  ["bench", "tiers", "--total", HUGE, "--block-bytes", "1GiB"],
                                  ["bench", "tiers", "--tier", "device", "--total", HUGE, "--block-bytes", "1GiB"],
                                  ["bench", "transport", "--transport", "tcp", "--total", HUGE, "--block-bytes", "1GiB"]],
                         ids=lambda a: " ".join(x for x in a if x != HUGE))
def test_capacity_beyond_memory_is_one_line(args):
    r = kvtier(*args, timeout=120)
    assert r.returncode in (1, 2), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("kvtier: error:")]) == 1, r.stderr


def test_missing_option_directories_are_not_created():
    kvtier("bench", "engine", "--disk", "/nonexistent/kvtier-test", timeout=120)
    kvtier("bench", "tiers", "--tier", "disk", "--path", "/nonexistent/kvtier-test", timeout=120)
    kvtier("bench", "adapter", "--disk", "/nonexistent/kvtier-test", timeout=120)
    assert not os.path.exists("/nonexistent/kvtier-test")


# -- tables ----------------------------------------------------------------------------------
TINY = {
    "tiers": ["bench", "tiers", "--block-bytes", "64KiB,1MiB", "--total", "4MiB", "--repeat", "1"],
    "device": ["bench", "tiers", "--tier", "device", "--block-bytes", "64KiB", "--total", "1MiB", "--repeat", "1"],
    "transport": ["bench", "transport", "--transport", "tcp", "--block-bytes", "1MiB", "--total", "2MiB",
                  "--repeat", "1"],
    "lookup": ["bench", "lookup", "--tokens", "4096", "--repeat", "2"],
    "adapter": ["bench", "adapter", "--page-tokens", "16", "--requests", "1", "--prompt-tokens", "256", "--layers", "2",
                "--repeat", "1", "--device", "cpu"],
    "engine": ["bench", "engine", "--prompt-tokens", "64", "--repeat", "1", "--batch", "1,2", "--decode-tokens", "3",
               "--tiers", "device,host"],
}
HEADINGS = {
    "tiers": ["op", "block", "GB/s", "raw GB/s", "ratio"],
    "device": ["op", "block", "GB/s", "raw GB/s", "ratio", "90% CI", "raw copy"],
    "transport": ["transport", "block", "GET GB/s", "raw GB/s", "ratio", "90% CI"],
    "lookup": ["tokens", "blocks", "keys ms", "lookup ms", "keys+lookup ms", "raw ms", "ratio"],
    "adapter": ["op", "page tokens", "blocks", "MiB", "GB/s", "raw GB/s", "ratio", "90% CI"],
    "engine": ["prefix in", "cached blocks from", "cached ms", "sched ms", "resident ms", "scratch ms", "speedup",
               "batch", "tokens/s", "ms per step"],
}


def _strict_env() -> dict:
    # COLUMNS as a 100-column terminal would set it; strict: a wider table is an error, not wrapped.
    return {**os.environ, "COLUMNS": "100", "KVTIER_STRICT_TABLES": "1"}


@pytest.mark.parametrize("name", list(TINY))
def test_table_fits_100_columns_when_piped(name):
    r = kvtier(*TINY[name], env=_strict_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines and max(len(ln) for ln in lines) <= 100, r.stdout
    heads = [ln for ln in lines if ln.startswith("┃")]
    cells = [c.strip() for ln in heads for c in ln.strip("┃").split("┃")]
    for h in HEADINGS[name]:
        assert h in cells, (h, cells)        # each heading whole, on one line


def test_engine_table_is_flat():
    r = kvtier(*TINY["engine"], env=_strict_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "{" not in r.stdout and "'" not in r.stdout, r.stdout
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in r.stdout.splitlines()
            if ln.startswith("│") and ln.split("│")[1].strip() in ("device", "host")}
    assert re.fullmatch(r"\d+ device", rows["device"]), rows
    parts = rows["host"].split(" + ")
    assert all(re.fullmatch(r"\d+ (device|host)", p) for p in parts) and any(p.endswith("host") for p in parts), rows


def test_engine_json_keeps_the_structure():
    r = kvtier(*TINY["engine"], "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    ttft = {x["case"]: x for x in rows if x["bench"] == "engine-ttft"}
    assert set(ttft) == {"device", "host"}
    assert ttft["host"]["cached_from"].get("host", 0) > 0
    assert sum(ttft["host"]["cached_from"].values()) * 16 == ttft["host"]["cached_tokens"]
    decode = [(x["batch"], x["cuda_graphs"]) for x in rows if x["bench"] == "engine-decode"]
    assert decode == ([(1, "on"), (1, "off"), (2, "on"), (2, "off")] if _cuda() else [(1, "off"), (2, "off")])
    # the part of a cached request's TTFT spent in the scheduler (admission, load start)
    assert all(0 < x["schedule_ms"] < x["ttft_cached_ms"] for x in ttft.values()), ttft
    # the same request again with its prefix resident (the host case's reference), and the wait
    # for the background copies of the request before it (the device case's store has no tier
    # below the pages, so nothing to wait for)
    assert all(x["ttft_resident_ms"] > 0 and x["backup_wait_ms"] >= 0 for x in ttft.values()), ttft
    assert ttft["device"]["ttft_resident_ms"] == ttft["device"]["ttft_cached_ms"] and ttft["device"]["vs_resident"] == 1
    assert ttft["host"]["vs_resident"] > 0


def test_paired_ratio_is_the_median_of_round_ratios(monkeypatch):
    """timeit_pair reports a's speed against b's round by round: a slow spell hitting both
    ops of one round moves neither the ratio nor, past its rank, the interval."""
    from kvtier.bench import common

    durations = iter([2, 1] + [2, 1, 1, 2] * 2 + [20, 10])   # warm-up, 4 rounds, then one slow round
    clock = [0.0]

    def fn() -> None:
        clock[0] += next(durations)

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    p = common.timeit_pair(fn, fn, 5)       # a b, b a, a b, b a, a b: a takes 2, b 1, then 20 and 10
    assert p.ratios == (0.5,) * 5 and p.ratio == 0.5 and p.low == p.high == 0.5
    assert (p.a, p.b) == (2, 1)


@pytest.mark.parametrize("n", [5, 9, 15, 31, 61])
def test_paired_interval_rank_covers_the_median_at_90_percent(n):
    """The interval [k-th smallest, k-th largest] misses the median only when at most k of
    n rounds fall on one side: both binomial tails together stay <= 10 %, and k is the
    largest such rank."""
    from math import comb

    from kvtier.bench.common import _rank

    def miss(k: int) -> float:
        return 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n
    k = _rank(n)
    assert miss(k) <= 0.1 < miss(k + 1)


def test_print_table_refuses_a_wide_table_when_strict(monkeypatch, capsys):
    from kvtier.bench.common import TableTooWide, print_table

    head = [f"column {i}" for i in range(12)]
    rows = [[f"{i * 1000.0:.1f}" for i in range(12)]]
    monkeypatch.setenv("KVTIER_STRICT_TABLES", "1")
    with pytest.raises(TableTooWide, match="more than 100"):
        print_table("wide", head, rows)
    monkeypatch.delenv("KVTIER_STRICT_TABLES")
    print_table("wide", head, rows)          # without strict: wrapped to fit
    out = capsys.readouterr().out
    assert out and max(len(ln) for ln in out.splitlines()) <= 100


def test_print_table_signature_still_takes_plain_rows(capsys):
    from kvtier.bench.common import print_table

    print_table("t", ["name", "value"], [["a", "1"], ["b", "22"]], left=1)
    out = capsys.readouterr().out
    assert "name" in out and "22" in out


# -- progress on a terminal, clean output ----------------------------------------------------
def run_with_terminal_stderr(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run `kvtier args` with stderr on a pseudo-terminal (as a person watching sees it) and
    stdout piped; returns (exit code, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *args], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen = bytearray()
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:                      # the child closed the terminal: it exited
            break
        if not data:
            break
        seen += data
    os.close(master)
    out = p.stdout.read().decode()
    return p.wait(timeout=timeout), out, seen.decode(errors="replace")


# Each command's first progress description: drawn even when the run is quick.
PROGRESS = {
    "tiers": (TINY["tiers"], "host tier"),
    "transport": (TINY["transport"], "transport"),
    "lookup": (TINY["lookup"], "lookup"),
    "engine": (TINY["engine"], "engine"),
    "demo": (["demo", "--sessions", "2", "--turns", "2", "--capacity", "256MiB"], "demo"),
    "generate": (["generate", "--prompt", "hi", "--max-tokens", "4", "--kv-cache", "4MiB", "--host-cache", "16MiB"],
                 "loading kimi-tiny"),
    "hit-ratio": (["bench", "hit-ratio", "--sessions", "20", "--policy", "lru", "--capacity", "5%"], "replaying"),
    # the cluster showed the reading spinner, then nothing for minutes on 4,096 nodes
    "cluster": (["bench", "cluster", "--sessions", "20", "--nodes", "2", "--router", "session"],
                "routing over 2 nodes"),
}


@pytest.mark.parametrize("name", list(PROGRESS))
def test_progress_shows_on_a_terminal_and_not_under_json(name):
    args, what = PROGRESS[name]
    code, out, term = run_with_terminal_stderr(*args)
    assert code == 0, term
    assert what in term and "\x1b[" in term, term       # a live bar or spinner was drawn
    assert "\x1b[" not in out                           # piped stdout has no terminal codes
    if name == "demo":                                  # what it prints goes to stdout, not the bar's terminal
        assert "turn 1:" in out and "turn 1:" not in term
    code, out, term = run_with_terminal_stderr(*args, "--json")
    assert code == 0, term
    assert term.strip() == "", term                     # nothing on the terminal under --json
    for line in out.splitlines():
        json.loads(line)                                # and stdout is JSON lines only


def test_disk_contention_script_rows_and_bad_options(tmp_path):
    """bench/disk_contention.py: one JSON line of setup, then one paired row per step, each
    with a ratio and its interval; a bad option is one argparse line, no traceback."""
    script = [sys.executable, "bench/disk_contention.py"]
    r = subprocess.run([*script, "--dir", str(tmp_path), "--total", "8MiB", "--repeat", "1"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    head, *rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert head["blocks"] == 8 and head["block_bytes"] == 1 << 20
    assert [row["row"] for row in rows] == ["raw + cpu work", "raw + hash other", "raw + hash same",
                                            "tier write", "store put"]
    assert all(row["ratio_low"] <= row["ratio"] <= row["ratio_high"] and row["ms"] > 0 for row in rows)
    assert list(tmp_path.iterdir()) == []               # its files are gone
    for bad in (["--block", "1000"], ["--dir", str(tmp_path / "missing")], ["--repeat", "0"]):
        r = subprocess.run([*script, *bad], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "error:" in r.stderr.strip().splitlines()[-1], r.stderr


def test_lmcache_compare_pairs_each_kvtier_move_with_lmcaches_in_the_same_rounds():
    """bench/lmcache_compare.py's rows (its LMCache run needs its own venv): the memcpy ratio
    and the speed-up over LMCache are medians of per-round ratios, the right way round."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lmcache_compare", REPO / "bench" / "lmcache_compare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lmcache_compare"] = mod          # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["lmcache_compare"]
    noop = lambda: None  # noqa: E731
    ops = [mod.Op("lmcache", "store", "vllm pages", 16, 256, noop, noop),
           mod.Op("kvtier", "save_from", "vllm pages", 16, 16, noop, noop)]
    # (memcpy s, op s) per round: LMCache takes 3x kvtier's time in every round; kvtier 0.5x memcpy's speed
    rounds = [[(1.0, 6.0), (2.0, 12.0), (1.0, 6.0)], [(1.0, 2.0), (2.0, 4.0), (1.0, 2.0)]]
    lmc, kv = mod._rows(ops, rounds, nbytes=10**9)
    assert kv["ratio"] == 0.5 and kv["vs_lmcache"] == 3.0 and kv["vs_lmcache_low"] <= 3.0 <= kv["vs_lmcache_high"]
    assert lmc["ratio"] == round(1 / 6, 3) and "vs_lmcache" not in lmc
    assert kv["gbps"] == 0.5 and kv["memcpy_gbps"] == 1.0
    (line,) = mod._summary([lmc, kv])
    assert "kvtier 3.00x LMCache" in line


def test_sigterm_stops_a_bench_as_ctrl_c_does(tmp_path):
    """`timeout 6 kvtier bench tiers --tier disk` died of SIGTERM's default action and left its
    512 MiB slab in /tmp: SIGTERM now stops every command as Ctrl-C does (its cleanup runs)."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "bench", "tiers", "--tier", "disk", "--path",
                          str(tmp_path), "--block-bytes", "1MiB", "--total", "64MiB", "--repeat", "500"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(tmp_path.rglob("slab.bin")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)                                     # into the rounds
    p.send_signal(signal.SIGTERM)
    _out, err = p.communicate(timeout=60)
    assert (p.returncode, err.splitlines()[-1:]) == (130, ["kvtier: interrupted"]), err
    assert list(tmp_path.iterdir()) == []


def test_bench_serve_table_fits_a_pipe(monkeypatch, capsys):
    """With the route column, a cell per percentile was past a pipe's 100 characters: "request"
    and "router" wrapped over two lines each."""
    from kvtier.bench import common
    from kvtier.bench.serve import table_columns
    monkeypatch.setenv("KVTIER_STRICT_TABLES", "1")
    monkeypatch.setenv("COLUMNS", "100")
    row = dict(route="request", mode="affinity", completed=80, lost=0, duplicates=0, out_tok_per_s=58.1,
               ttft_p50_ms=124.2, ttft_p90_ms=270.9, ttft_p99_ms=500.3, itl_p50_ms=15.3, itl_p90_ms=47.1,
               itl_p99_ms=114.4, hit_ratio=0.581)
    common.emit([row, dict(row, route="router")], False, "kvtier serve x2, 12 agents (think 1 s), 4 streams at most, "
                "16 tokens each (kv 6 MiB, host 8 MiB)", table_columns(2), left=1)
    out = capsys.readouterr().out
    assert "request" in out and "router" in out and "80/0/0" in out and "124/271/500" in out, out
