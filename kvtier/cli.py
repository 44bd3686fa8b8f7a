"""The `kvtier` command: demo, benchmarks and tools.

Each benchmark is a module in kvtier/bench/ exposing HELP, add_arguments(parser) and
run(args) -> exit code; list it in BENCHES. Modules import heavy things inside run(),
so `kvtier --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvtier.errors import KvtierError

BENCHES: dict[str, str] = {
    "lookup": "kvtier.bench.lookup",
    "tiers": "kvtier.bench.tiers",
    "hit-ratio": "kvtier.bench.hit_ratio",
    "cluster": "kvtier.bench.cluster",
    "transport": "kvtier.bench.transport",
    "engine": "kvtier.bench.engine",
}
COMMANDS: dict[str, str] = {
    "demo": "kvtier.demo",
    "inspect": "kvtier.inspect",
    "node": "kvtier.node_cli",
    "generate": "kvtier.engine.generate_cli",
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None   # a benchmark not built yet in this checkout
        raise


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="A tiered KV-cache store for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = _load(module)
        if mod is not None:
            p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    bench = sub.add_parser("bench", help="benchmarks, each against a raw baseline in the same run")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, module in BENCHES.items():
        mod = _load(module)
        if mod is not None:
            p = bsub.add_parser(name, help=mod.HELP, description=mod.HELP)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run)
    bench.set_defaults(run=lambda _args: (bench.print_help(), 2)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KvtierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
