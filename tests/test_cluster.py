"""Cluster simulation: routers on hand-made traces, and the CLI's JSON."""
from __future__ import annotations

import json

import pytest

from kvtier.cli import main
from kvtier.errors import ConfigError
from kvtier.sim.cluster import ROUTERS, simulate
from kvtier.traces.model import Request, Trace


def T(*reqs, sessions=None):
    return Trace("hand", [Request(list(r), 16 * len(r), session=(sessions[i] if sessions else None))
                          for i, r in enumerate(reqs)], 16)


def test_round_robin_splits_a_repeated_prefix():
    tr = T([1, 2], [1, 2], [1, 2], [1, 2])
    rr = simulate(tr, "round-robin", 2, 4)
    assert rr.prefix_hits == 4                        # each node misses once, then hits both
    assert rr.computed == [32, 32] and rr.load_imbalance == 1.0
    kv = simulate(tr, "kv-aware", 2, 4)
    assert kv.prefix_hits == 6 and kv.load_imbalance == pytest.approx(2.0)
    pooled = simulate(tr, "pooled", 2, 4)
    assert pooled.prefix_hits == 6                    # node 2 fetches node 1's blocks


def test_session_router_uses_session_field():
    tr = T([1], [2], [1], [2], sessions=["a", "b", "a", "b"])
    s = simulate(tr, "session", 4, 2)
    assert s.prefix_hits == 2                         # each session returns to its node


def test_token_aware_balances_shared_roots():
    # Every request starts with the same block, as in the conversation trace.
    reqs = [[0] + [100 * i + j for j in range(1, 4)] for i in range(40)]
    reqs += reqs                                       # each conversation comes back once
    tr = T(*reqs)
    kv = simulate(tr, "kv-aware", 4, 200)
    ta = simulate(tr, "token-aware", 4, 200)
    assert kv.load_imbalance > 1.5                    # naive prefix routing piles up on one node
    assert ta.load_imbalance <= 1.25
    assert ta.prefix_hit_ratio >= simulate(tr, "pooled", 4, 200).prefix_hit_ratio - 0.02


def test_errors_and_cli(capsys, tmp_path):
    with pytest.raises(ConfigError):
        simulate(T([1]), "magic", 2, 2)
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "hash_ids": [0, i % 3 + 1]}) + "\n"
                         for i in range(12)))
    assert main(["bench", "cluster", str(p), "--nodes", "2", "--capacity", "50%", "--router", "all", "--json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["router"] for r in rows] == list(ROUTERS)
    assert {"trace", "router", "nodes", "capacity_blocks", "prefix_hit_ratio", "load_imbalance"} <= set(rows[0])
