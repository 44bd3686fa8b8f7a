"""The `kvtier` command as a user runs it: subprocesses, real output."""
import json

from conftest import assert_one_line_error, run_kvtier as kvtier


def test_demo_runs_and_verifies_loads():
    r = kvtier("demo", "--sessions", "2", "--turns", "3", "--capacity", "256MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("every load verified") == 3


def test_demo_json_is_only_json():
    r = kvtier("demo", "--sessions", "2", "--turns", "3", "--capacity", "256MiB", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)              # the whole of stdout is one JSON object
    assert out["verified"] is True and [t["verified"] for t in out["turns"]] == [True] * 3
    assert [t["turn"] for t in out["turns"]] == [1, 2, 3]
    assert out["verified_blocks"] == sum(t["verified_blocks"] for t in out["turns"]) > 0
    assert out["cached_tokens"] == sum(t["cached_tokens"] for t in out["turns"]) > 0
    stats = out["stats"]
    assert stats["counters"]["lookup_hit_blocks"] > 0 and stats["counters"]["gets"] > 0


def test_bench_lookup_json():
    r = kvtier("bench", "lookup", "--tokens", "8192", "--repeat", "3", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["blocks"] == 512 and row["baseline_ms"] > 0 and row["total_ms"] > 0
    assert abs(row["ratio"] - row["baseline_ms"] / row["total_ms"]) < 1e-9


def test_bench_tiers_json_fields():
    r = kvtier("bench", "tiers", "--block-bytes", "64KiB,1MiB", "--total", "8MiB", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["op"], x["block_bytes"]) for x in rows] == [("put", 65536), ("get", 65536), ("put", 1 << 20), ("get", 1 << 20)]
    for x in rows:
        assert set(x) >= {"tier", "op", "block_bytes", "gbps", "baseline_gbps", "ratio"}
        assert x["gbps"] > 0 and abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 1e-9


def test_errors_are_one_line_with_a_hint():
    r = kvtier("demo", "--capacity", "lots")
    assert_one_line_error(r, 2, "--capacity", "cannot parse size 'lots'")
    r = kvtier("demo", "--layout", "gpt-9")
    assert_one_line_error(r, 2, "--layout", "kimi-k2")
    r = kvtier("demo", "--capacity", "-5GiB")           # a value, not an unknown option
    assert_one_line_error(r, 2, "--capacity", "'-5GiB' is not a size > 0 bytes")
    r = kvtier("demo", "--sessions", "100000")          # was taken: about a day's run
    assert_one_line_error(r, 2, "--sessions 100,000 x --turns 5", "at most 10,000")
    r = kvtier()                                        # no command: the help, then the error line
    assert_one_line_error(r, 2, "give a command")
    assert "bench" in r.stderr and not r.stdout
    assert_one_line_error(kvtier("bench"), 2, "give a benchmark")


def test_usage_errors_are_one_line_exit_2():
    r = kvtier("bench", "hit-ratio", "--no-such-option")
    assert_one_line_error(r, 2, "--no-such-option", "--help")
    r = kvtier("--log-level", "loud", "demo")
    assert_one_line_error(r, 2, "--log-level")


def test_log_level_from_the_environment_is_checked():
    import os
    r = kvtier("bench", "hit-ratio", "--capacity", "1%", "--policy", "lru", "--json",
               env={**os.environ, "KVTIER_LOG_LEVEL": "chatty"})
    assert_one_line_error(r, 2, "KVTIER_LOG_LEVEL")


def test_broken_pipe_is_quiet():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "bench", "hit-ratio", "--json", "--policy", "all"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()      # like `| head -1`
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) != 0
    assert err == "", err


def test_every_option_says_its_default():
    """Every option of every command has help text, and the help shows its default."""
    import argparse

    from kvtier.cli import build_parser

    def parsers(p: argparse.ArgumentParser):
        yield p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from parsers(sub)

    for p in parsers(build_parser()):
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            assert a.help, f"{p.prog} {a.option_strings[0]} has no help text"
            shown = fmt._expand_help(a) if hasattr(fmt, "_expand_help") else a.help
            has_default = not (a.default is None or a.default is False or a.default is argparse.SUPPRESS)
            if has_default and not isinstance(a, argparse._VersionAction):
                assert "default" in shown, f"{p.prog} {a.option_strings[0]}: help does not say the default"


def test_ctrl_c_while_the_options_are_read_is_one_line(monkeypatch, capsys):
    """Option types import what they check (kvtier.net for addresses): a Ctrl-C in the first
    half-second of `kvtier node` landed in argparse and printed a traceback."""
    import kvtier.cli as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli.Parser, "parse_known_args", interrupted)
    assert cli.main(["node", "--listen", "127.0.0.1:0"]) == 130
    assert capsys.readouterr().err == "kvtier: interrupted\n"
