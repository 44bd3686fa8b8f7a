"""`kvtier bench hit-ratio`: replay request traces through the store's BlockIndex
(metadata only) and print prefix and token hit ratios per policy and capacity.

The replay drives the very policy objects the store uses, so the ratios printed are the
ones a store of that size and policy gets. Belady (MIN) is the offline bound.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "hit ratio of each eviction policy and capacity on a request trace (Mooncake or token-level)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="*", metavar="TRACE",
                   help="JSONL trace file(s), Mooncake or token-level (detected). None: a generated agentic trace")
    p.add_argument("--synthetic", action="store_true",
                   help="replay a generated agentic trace (the default when no TRACE is given)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--sessions", type=int, default=200, help="sessions in the generated trace (default 200)")
    p.add_argument("--policy", default="lru,recommended,belady",
                   help="comma-separated policies: lru, lfu, s3fifo, arc, POLICY+nopartial, belady "
                        "(offline bound), recommended (the store's default), all (default: %(default)s)")
    p.add_argument("--capacity", default="1%,5%,10%,25%,50%",
                   help="comma-separated capacities: '5%%' or '0.05' of unique blocks, '2000' blocks, "
                        "or '64GiB' with --layout (default: %(default)s)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens a block for token-level traces (default 512; Mooncake traces are 512)")
    p.add_argument("--layout", default=None, help="KV layout preset for byte capacities, e.g. kimi-k2")
    p.add_argument("--json", action="store_true", help="one JSON object per (trace, policy, capacity)")
    p.add_argument("--plot", metavar="PNG", default=None, help="write hit ratio against capacity as a PNG")


def expand_policies(text: str) -> list[str]:
    """Policy names from the --policy list, 'all' and 'recommended' expanded, in order."""
    from kvtier.errors import ConfigError
    from kvtier.policies import DEFAULT_POLICY, make_policy, policy_names

    out: list[str] = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        names = [*policy_names(), "belady"] if name == "all" else [DEFAULT_POLICY if name == "recommended" else name]
        for n in names:
            if n != "belady":
                make_policy(n, 1)   # validates the name with a helpful error
            if n not in out:
                out.append(n)
    if not out:
        raise ConfigError("--policy is empty: name at least one policy, e.g. lru,belady")
    return out


def _load_traces(args: argparse.Namespace) -> list[Any]:
    from kvtier.traces import AgenticConfig, read_trace, synthetic_trace

    traces = [read_trace(p, block_tokens=args.block_tokens) for p in args.trace]
    if args.synthetic or not traces:
        traces.append(synthetic_trace(AgenticConfig(seed=args.seed, sessions=args.sessions,
                                                    block_tokens=args.block_tokens or 512)))
    return traces


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.progress import progress
    from kvtier.sim.capacity import parse_capacities
    from kvtier.sim.replay import replay

    policies = expand_policies(args.policy)
    caps = parse_capacities(args.capacity)
    if not caps:
        raise ConfigError("--capacity is empty: give e.g. 1%,5%,10%")
    block_bytes = None
    if args.layout:
        from kvtier.layout import preset_layout
        block_bytes = preset_layout(args.layout, args.block_tokens or 512).block_bytes
    traces = _load_traces(args)
    results = []
    work = sum(len(t) for t in traces) * len(policies) * len(caps)
    with progress("replaying", work, enabled=not args.json) as bar:
        for tr in traces:
            for cap in caps:
                blocks = cap.blocks_for(tr.unique_blocks, block_bytes)
                for pol in policies:
                    bar.describe(f"{tr.name} {pol} {cap.text}")
                    done = [0]

                    def tick(i: int, done: list[int] = done) -> None:
                        bar.advance(i - done[0])
                        done[0] = i
                    r = replay(tr, pol, blocks, progress=tick if bar.shown else None)
                    bar.advance(len(tr) - done[0])
                    results.append((cap, r))
                    if args.json:
                        print(json.dumps(r.to_json()), flush=True)
    if not args.json:
        _print_table(results, block_bytes)
    if args.plot:
        from kvtier.bench.hit_ratio_plot import plot
        plot([r for _c, r in results], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _print_table(results: list, block_bytes: int | None) -> None:
    from kvtier.bench.common import print_table
    from kvtier.units import format_bytes

    head = ["trace", "policy", "capacity", "blocks", "fraction", "prefix hit", "token hit", "evictions"]
    if block_bytes:
        head.insert(4, "bytes")
    rows = []
    for cap, r in results:
        label = f"{r.policy} (offline bound)" if r.offline else r.policy
        row = [r.trace, label, cap.text, f"{r.capacity_blocks:,}", f"{r.capacity_fraction:.2%}",
               f"{r.prefix_hit_ratio:.4f}", f"{r.token_hit_ratio:.4f}", f"{r.evictions:,}"]
        if block_bytes:
            row.insert(4, format_bytes(r.capacity_blocks * block_bytes))
        rows.append(row)
    print_table("Prefix hit ratio by policy and capacity (Belady = offline bound)", head, rows, left=2)
