"""`kvtier bench cluster`: N nodes, each with its own cache, behind a router; prints
per router the cluster-wide prefix hit ratio and load balance (max/mean tokens computed)."""
from __future__ import annotations

import argparse
import json
import textwrap

from kvtier.argtypes import positive_int

HELP = "cluster-wide hit ratio and load balance of request routers over N per-node caches"

LEGEND = """\
How to read the table:
  blocks/node    each node's cache (--capacity) in blocks of the trace
  prefix hit     share of the trace's block references served from the cache of the node the
                 request went to (pooled: from any node), leading run of cached blocks only
  max/mean load  prompt tokens computed (cache misses) by the busiest node / by the average
                 node: 1.000 is a perfect balance, 8.000 on 8 nodes means one node does all
  routers        random, round-robin: ignore the cache; session: a request's session (or a hash
                 of its first blocks) picks the node; kv-aware: the longest cached prefix;
                 pooled: any node reads any node's blocks (one shared cache, to compare with);
                 token-aware: the longest cached prefix among nodes that stay balanced;
                 dynamo: min(uncached prefill blocks + load blocks); sglang: the longest prefix
                 unless the load gap is > 64 tokens and > 1.5x, then the least loaded"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.hit_ratio import add_trace_arguments
    from kvtier.policies import DEFAULT_POLICY, POLICIES
    from kvtier.sim.cluster import ROUTERS

    add_trace_arguments(p)
    p.add_argument("--nodes", type=positive_int, default=8, help="nodes in the cluster, each with its own cache "
                   "(at most 4096)")
    p.add_argument("--capacity", default="2%",
                   help="each node's cache: '2%%' or '0.02' of the trace's unique blocks, '2000' blocks, "
                        "or '64GiB' with --layout; at or above the unique blocks it is run as exactly "
                        "the unique blocks (an infinite cache) (default: %(default)s)")
    p.add_argument("--policy", default="recommended",
                   help=f"each node's eviction policy: {', '.join(POLICIES)}, optionally +nopartial, or "
                        f"recommended (the store's default, {DEFAULT_POLICY}) (default: %(default)s)")
    p.add_argument("--router", default="all",
                   help=f"comma-separated routers: {', '.join(ROUTERS)}, or all (default: %(default)s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per (trace, router) instead of a table")


def parse_routers(text: str) -> list[str]:
    from kvtier.errors import ConfigError
    from kvtier.sim.cluster import ROUTERS

    routers: list[str] = []
    for r in (x.strip() for x in text.split(",") if x.strip()):
        for name in (ROUTERS if r == "all" else (r,)):
            if name not in ROUTERS:
                raise ConfigError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)} or 'all'")
            if name not in routers:
                routers.append(name)
    if not routers:
        raise ConfigError("--router is empty: name at least one router, e.g. session,token-aware, or all")
    return routers


MAX_NODES = 4096          # nodes a simulated cluster may have


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.hit_ratio import block_bytes_of, check_byte_capacities, load_traces
    from kvtier.errors import ConfigError
    from kvtier.policies import DEFAULT_POLICY, make_policy
    from kvtier.sim.capacity import parse_capacity
    from kvtier.sim.cluster import simulate

    if args.nodes > MAX_NODES:
        raise ConfigError(f"--nodes {args.nodes}: at most {MAX_NODES} (each node is a simulated cache of its own; "
                          "a million took minutes and gigabytes on a five-request trace)")
    routers = parse_routers(args.router)
    policy = DEFAULT_POLICY if args.policy == "recommended" else args.policy
    make_policy(policy, 1)
    if "," in args.capacity:
        raise ConfigError(f"--capacity {args.capacity!r}: the cluster takes one per-node size, e.g. 2%")
    cap = parse_capacity(args.capacity)
    block_bytes = block_bytes_of(args)
    check_byte_capacities([cap], block_bytes)
    rows, lines = [], []
    from kvtier.bench.hit_ratio_report import describe_trace
    for tr in load_traces(args):
        lines += describe_trace(tr)
        asked = cap.blocks_for(tr.unique_blocks, block_bytes)
        if asked > tr.unique_blocks:
            lines += textwrap.wrap(f"  --capacity {cap.text} is above the trace's {tr.unique_blocks:,} unique "
                                   "blocks: an infinite cache on each node", 100,
                                   subsequent_indent="    ")
        for r in routers:
            res = simulate(tr, r, args.nodes, asked, policy=policy)
            if args.json:
                print(json.dumps({**res.to_json(), "capacity": cap.text,
                                  "capacity_clamped": asked > res.capacity_blocks}), flush=True)
            rows.append(res)
    if not args.json:
        from kvtier.bench.common import print_table
        print("\n".join(lines))
        print_table(f"Routers over {args.nodes} nodes ({policy} on each)",
                    ["trace", "router", "blocks/node", "prefix hit", "max/mean load"],
                    [[x.trace, x.router, f"{x.capacity_blocks:,}", f"{x.prefix_hit_ratio:.4f}",
                      f"{x.load_imbalance:.3f}"] for x in rows], left=2)
        print()
        print(LEGEND)
    return 0
