"""Metadata-only replay: hand-computed hit ratios, the per-request hit sequence,
capacities, the CLI, and the README reference table on the real traces (slow)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.sim import capacity_for, replay
from kvtier.sim.capacity import parse_capacity
from kvtier.traces import read_trace
from kvtier.traces.model import Request, Trace

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def T(*reqs, last=None):
    return Trace("hand", [Request(list(r), 16 * len(r)) for r in reqs], 16)


def test_lru_hand_computed():
    tr = T([1, 2], [1, 3], [1, 2])
    # cap 3: nothing evicted; hits 0 + 1 (block 1) + 2 = 3 of 6 references.
    r = replay(tr, "lru", 3)
    assert r.hits == [0, 1, 2] and r.prefix_hit_ratio == pytest.approx(3 / 6)
    # cap 2: request 2 inserts 3 and evicts 2 (the leaf; 1 was refreshed): 0 + 1 + 1;
    # request 3 then re-inserts 2, evicting 3.
    r = replay(tr, "lru", 2)
    assert r.hits == [0, 1, 1] and r.evictions == 2
    assert r.token_hit_ratio == pytest.approx(2 * 16 / (6 * 16))


def test_belady_hand_computed():
    # cap 2: MIN does not insert 3 (never used again), so request 3 hits both blocks.
    r = replay(T([1, 2], [1, 3], [1, 2]), "belady", 2)
    assert r.hits == [0, 1, 2] and r.offline and r.evictions == 0
    # cap 1: only the root can be kept; 1 is used by every request.
    r = replay(T([1, 2], [1, 3], [1, 2]), "belady", 1)
    assert r.hits == [0, 1, 1]


def test_prefix_stops_at_first_miss_and_token_hits():
    tr = Trace("hand", [Request([1, 2, 3], 40, last_tokens=8), Request([1, 2, 3], 40, last_tokens=8),
                        Request([1, 5, 3], 40, last_tokens=8)], 16)
    r = replay(tr, "lru", 10)
    # 3 is cached but follows a miss: a prefix cache cannot use it.
    assert r.hits == [0, 3, 1]
    assert r.token_hits == 40 + 16 and r.tokens == 120
    r = replay(tr, "lru+nopartial", 10)                  # the partial block 3 is never cached
    assert r.hits == [0, 2, 1]


def test_requests_larger_than_the_cache():
    r = replay(T([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), "lru", 2)
    assert r.hits == [0, 2]                              # the 2 blocks nearest the root are kept
    assert replay(T([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), "belady", 2).hits == [0, 2]


def test_capacity_specs():
    tr = T([1, 2], [3])
    assert capacity_for(tr, 0.5) == 2 and capacity_for(tr, 0.01) == 1
    assert parse_capacity("5%").fraction == pytest.approx(0.05)
    assert parse_capacity("0.1").fraction == pytest.approx(0.1)
    assert parse_capacity("2000").blocks == 2000
    c = parse_capacity("64GiB")
    assert c.blocks_for(10, 1 << 30) == 64
    with pytest.raises(ConfigError, match="--layout"):
        c.blocks_for(10, None)
    with pytest.raises(ConfigError):
        parse_capacity("lots")
    with pytest.raises(ConfigError):
        replay(tr, "lru", 0)


@pytest.mark.parametrize("text", ["0", "0%", "-5%", "inf%", "nan%", "0.0", "5 %x"])
def test_capacity_specs_rejected(text):
    with pytest.raises(ConfigError):
        parse_capacity(text)


def test_one_rule_above_the_unique_blocks():
    """'150%' and '1.5' are the same spec; any size at or above the trace's unique blocks
    runs as exactly the unique blocks (nothing is evicted) and gives the same hits."""
    from kvtier.sim.capacity import effective_blocks
    assert parse_capacity("150%").fraction == pytest.approx(parse_capacity("1.5").fraction) == pytest.approx(1.5)
    tr = T([1, 2], [1, 3], [1, 2], [4])
    assert tr.unique_blocks == 4
    assert effective_blocks(10**12, 4) == 4 and effective_blocks(3, 4) == 3
    whole = replay(tr, "lru", 4)
    for asked in (5, 10**12, capacity_for(tr, 1.5)):
        for pol in ("lru", "belady", "s3fifo"):
            r = replay(tr, pol, asked)
            assert r.capacity_blocks == 4 and r.capacity_fraction == 1.0 and r.evictions == 0
            assert r.hits == whole.hits


def test_token_hits_skip_the_uncached_tail():
    # Token-level keys cover full blocks only: a 20-token prompt of 16-token blocks has one key,
    # and a full hit saves 16 tokens, not 20.
    tr = Trace("tok", [Request([1], 20), Request([1], 20)], 16, format="tokens")
    r = replay(tr, "lru", 4)
    assert r.hits == [0, 1] and r.token_hits == 16 and r.tokens == 40


def test_cli_json_and_plot(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "hash_ids": [0, i + 1]}) + "\n"
                         for i in range(5)))
    png = tmp_path / "h.png"
    assert main(["bench", "hit-ratio", str(p), "--policy", "lru,belady", "--capacity", "50%,2",
                 "--json", "--plot", str(png)]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4
    assert {"trace", "policy", "capacity_blocks", "capacity_fraction", "prefix_hit_ratio",
            "token_hit_ratio", "evictions"} <= set(rows[0])
    assert rows[0]["capacity_blocks"] == 3 and rows[0]["prefix_hit_ratio"] == pytest.approx(4 / 10)
    assert png.stat().st_size > 10_000
    assert main(["bench", "hit-ratio", str(p), "--policy", "nope"]) == 2


def test_plot_keeps_one_colour_per_policy_and_labels_the_capacities():
    import matplotlib.pyplot as plt
    from kvtier.bench.hit_ratio_plot import figure
    tr = Trace("t", [Request([i % 7, 100 + i], 1024) for i in range(40)], 512)
    pols = ["lru", "arc", "lfu", "s3fifo", "lru+nopartial", "arc+nopartial", "lfu+nopartial",
            "s3fifo+nopartial", "reuse", "reuse+nopartial", "belady"]
    results = [replay(tr, p, c) for p in pols for c in (3, 5, 12)]
    fig = figure(results)
    try:
        ax = fig.axes[0]
        colours = {l.get_label(): l.get_color() for l in ax.get_lines()}
        assert len(colours) == len(pols)
        online = [c for label, c in colours.items() if "offline" not in label]
        assert colours["belady (offline bound)"] not in online     # 10 online lines: the cycle wrapped
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_xticklabels()]
        want = [f"{100 * c / 47:.3g}%" for c in (3, 5, 12)]          # 7 + 40 unique blocks
        assert labels == want, labels
        assert not any(t.get_text() for t in ax.get_xticklabels(minor=True))
    finally:
        plt.close(fig)


def test_cli_synthetic_default(capsys):
    assert main(["bench", "hit-ratio", "--sessions", "8", "--policy", "recommended,belady",
                 "--capacity", "10%", "--json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["trace"].startswith("agentic")
    assert rows[1]["prefix_hit_ratio"] >= rows[0]["prefix_hit_ratio"]


# A few points of the README's reference table, reproduced to 4 decimals.
REFERENCE = [("conversation", "lru", 0.05, 0.1958), ("conversation", "belady", 0.01, 0.2464),
             ("synthetic", "lru", 0.25, 0.4441), ("synthetic", "belady", 0.05, 0.3957)]


@pytest.mark.slow
@pytest.mark.skipif(not SHARED.is_dir(), reason=f"real traces not found at {SHARED} (../shared/traces)")
@pytest.mark.parametrize("trace, policy, frac, expect", REFERENCE)
def test_reference_table(trace, policy, frac, expect):
    tr = read_trace(os.fspath(SHARED / f"{trace}_trace.jsonl"))
    r = replay(tr, policy, capacity_for(tr, frac))
    assert round(r.prefix_hit_ratio, 4) == expect
