"""`kvtier bench cluster`: N nodes, each with its own cache, behind a router; prints
per router the cluster-wide prefix hit ratio and load balance (max/mean tokens computed)."""
from __future__ import annotations

import argparse
import json

HELP = "cluster-wide hit ratio and load balance of request routers over N per-node caches"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="*", metavar="TRACE",
                   help="JSONL trace file(s), Mooncake or token-level. None: a generated agentic trace")
    p.add_argument("--synthetic", action="store_true", help="also run a generated agentic trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--capacity", default="2%",
                   help="per-node cache: '2%%' of the trace's unique blocks, blocks, or bytes with --layout")
    p.add_argument("--layout", default=None)
    p.add_argument("--block-tokens", type=int, default=None)
    p.add_argument("--policy", default="recommended", help="each node's eviction policy (default %(default)s)")
    p.add_argument("--router", default="all",
                   help="comma-separated: random, round-robin, session, kv-aware, pooled, token-aware, all")
    p.add_argument("--json", action="store_true", help="one JSON object per (trace, router)")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.hit_ratio import _load_traces
    from kvtier.errors import ConfigError
    from kvtier.policies import DEFAULT_POLICY, make_policy
    from kvtier.sim.capacity import parse_capacity
    from kvtier.sim.cluster import ROUTERS, simulate

    routers = []
    for r in (x.strip() for x in args.router.split(",") if x.strip()):
        for name in (ROUTERS if r == "all" else (r,)):
            if name not in ROUTERS:
                raise ConfigError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)} or 'all'")
            if name not in routers:
                routers.append(name)
    policy = DEFAULT_POLICY if args.policy == "recommended" else args.policy
    make_policy(policy, 1)
    cap = parse_capacity(args.capacity)
    block_bytes = None
    if args.layout:
        from kvtier.layout import preset_layout
        block_bytes = preset_layout(args.layout, args.block_tokens or 512).block_bytes
    rows = []
    for tr in _load_traces(args):
        blocks = cap.blocks_for(tr.unique_blocks, block_bytes)
        for r in routers:
            res = simulate(tr, r, args.nodes, blocks, policy=policy)
            if args.json:
                print(json.dumps(res.to_json()), flush=True)
            rows.append(res)
    if not args.json:
        from kvtier.bench.common import print_table
        print_table("Cluster: prefix hit ratio and load balance by router",
                    ["trace", "router", "nodes", "blocks/node", "prefix hit", "max/mean load"],
                    [[x.trace, x.router, str(x.nodes), f"{x.capacity_blocks:,}", f"{x.prefix_hit_ratio:.4f}",
                      f"{x.load_imbalance:.3f}"] for x in rows], left=2)
    return 0
