"""`kvtier bench adapter`: the engine's pages <-> kvtier's tiers, timed against memcpy."""
import json

from conftest import assert_one_line_error, run_kvtier


def test_rows_for_each_page_size_and_op():
    r = run_kvtier("bench", "adapter", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                   "--prompt-tokens", "256", "--page-tokens", "16,64", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    ops = ["load_into", "save_from", "load_host", "load_disk"]
    assert [(x["op"], x["page_tokens"], x["blocks"]) for x in rows] == \
        [(op, 16, 32) for op in ops] + [(op, 64, 8) for op in ops]
    for x in rows:
        assert x["gbps"] > 0 and x["memcpy_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["memcpy_gbps"]) < 0.01


def test_bad_page_sizes_are_usage_errors():
    assert_one_line_error(run_kvtier("bench", "adapter", "--page-tokens", "0"), 2, "--page-tokens")
    assert_one_line_error(run_kvtier("bench", "adapter", "--page-tokens", "512", "--prompt-tokens", "256"), 2,
                          "no full 512-token page")
