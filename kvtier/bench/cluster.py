"""`kvtier bench cluster`: N nodes, each with its own cache, behind a router; prints
per router the cluster-wide prefix hit ratio and load balance (max/mean tokens computed)."""
from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

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
                 dynamo: min(uncached prefill blocks + load blocks); sglang: the least loaded
                 if the load gap is > 64 tokens and > 1.5x, else the longest cached prefix if
                 it covers at least half the prompt, else the least loaded"""


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


def _check_args(args: argparse.Namespace) -> tuple[list[str], str, Any, int | None]:
    """Every option checked before a trace is read: the routers, the policy, the capacity
    and the bytes of a block (under --layout)."""
    from kvtier.bench.hit_ratio import block_bytes_of, check_byte_capacities, check_filters_once
    from kvtier.errors import ConfigError
    from kvtier.policies import DEFAULT_POLICY, make_policy
    from kvtier.sim.capacity import parse_capacity

    if args.nodes > MAX_NODES:
        raise ConfigError(f"--nodes {args.nodes}: at most {MAX_NODES} (each node is a simulated cache of its own; "
                          "a million took minutes and gigabytes on a five-request trace)")
    routers = parse_routers(args.router)
    policy = DEFAULT_POLICY if args.policy == "recommended" else args.policy
    check_filters_once(policy)
    make_policy(policy, 1)
    if "," in args.capacity:
        raise ConfigError(f"--capacity {args.capacity!r}: the cluster takes one per-node size, e.g. 2%")
    cap = parse_capacity(args.capacity)
    block_bytes = block_bytes_of(args)
    check_byte_capacities([cap], block_bytes)
    return routers, policy, cap, block_bytes


def _clamp_note(tr: Any, cap: Any, asked: int) -> list[str]:
    """The line saying a capacity above the trace runs as an infinite cache, if it does."""
    if asked <= tr.unique_blocks:
        return []
    return textwrap.wrap(f"  --capacity {cap.text} is above the trace's {tr.unique_blocks:,} unique "
                         "blocks: an infinite cache on each node", 100, subsequent_indent="    ")


def _print_table(args: argparse.Namespace, policy: str, lines: list[str], rows: list[Any]) -> None:
    """The headers, the table of routers and the legend, for a person."""
    from kvtier.bench.common import print_table

    print("\n".join(lines))
    print_table(f"Routers over {args.nodes} nodes ({policy} on each)",
                ["trace", "router", "blocks/node", "prefix hit", "max/mean load"],
                [[x.trace, x.router, f"{x.capacity_blocks:,}", f"{x.prefix_hit_ratio:.4f}",
                  f"{x.load_imbalance:.3f}"] for x in rows], left=2)
    print()
    print(LEGEND)


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import replay_ticks
    from kvtier.bench.hit_ratio import load_traces
    from kvtier.bench.hit_ratio_report import describe_trace
    from kvtier.progress import progress
    from kvtier.sim.cluster import simulate

    routers, policy, cap, block_bytes = _check_args(args)
    traces = load_traces(args)
    rows, lines = [], []
    # A bar over every (trace, router) replay: 4,096 nodes on a real trace take minutes,
    # and nothing else is printed until the table.
    work = sum(len(tr) for tr in traces) * len(routers)
    with progress(f"routing over {args.nodes:,} nodes", work, enabled=not args.json) as bar:
        for tr in traces:
            lines += describe_trace(tr)
            asked = cap.blocks_for(tr.unique_blocks, block_bytes)
            lines += _clamp_note(tr, cap, asked)
            for r in routers:
                bar.describe(f"{tr.name} {r} over {args.nodes:,} nodes")
                with replay_ticks(bar, len(tr)) as tick:
                    res = simulate(tr, r, args.nodes, asked, policy=policy, progress=tick)
                if args.json:
                    print(json.dumps({**res.to_json(), "capacity": cap.text,
                                      "capacity_clamped": asked > res.capacity_blocks}), flush=True)
                rows.append(res)
    if not args.json:
        _print_table(args, policy, lines, rows)
    return 0
