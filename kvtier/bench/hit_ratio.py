"""`kvtier bench hit-ratio`: replay request traces through the store's BlockIndex
(metadata only) and print prefix and token hit ratios per policy and capacity.

The replay drives the very policy objects the store uses, so the ratios printed are the
ones a store of that size and policy gets. Belady (MIN) is the offline bound. Every
option is checked, the --plot path included, before the first trace is read, so a bad
argument fails at once instead of after the replay.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from kvtier.argtypes import int_between, non_negative_int, positive_int

if TYPE_CHECKING:
    from kvtier.sim.capacity import Capacity

HELP = "hit ratio of each eviction policy and capacity on a request trace (Mooncake or token-level)"
DEFAULT_POLICIES = "lru,recommended,arc,belady"
DEFAULT_CAPACITIES = "1%,5%,10%,25%,50%"
#: The largest --block-tokens: far past any real block (16 to 512 tokens), small enough
#: that keying a prompt in such blocks cannot overflow.
MAX_BLOCK_TOKENS = 1 << 20


def policy_help() -> str:
    """The --policy choices, from the registry (so a new policy shows up by itself)."""
    from kvtier.policies import DEFAULT_POLICY, FILTERS, POLICIES

    rules = ", ".join(f"+{r}" for r in FILTERS)
    return (f"comma-separated policies: {', '.join(POLICIES)}, each optionally with an admission "
            f"filter ({rules}, e.g. arc+nopartial); recommended (the store's default, {DEFAULT_POLICY}); "
            "belady (the offline bound: the best any cache could do, knowing the future); "
            "all (every one of these) (default: %(default)s)")


CAPACITY_HELP = ("comma-separated cache sizes: '5%%' or '0.05' of the trace's unique blocks, '2000' "
                 "blocks, or '64GiB' with --layout. A size at or above the trace's unique blocks "
                 "(e.g. 150%% or 1.5) is an infinite cache: it is run as exactly the unique blocks "
                 "and the output says so")


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace options hit-ratio and cluster share."""
    p.add_argument("trace", nargs="*", metavar="TRACE",
                   help="JSONL trace file(s), Mooncake or token-level (detected), plain or gzip; '-' reads "
                        "standard input (named stdin). A file given twice is replayed once; traces whose "
                        "names clash are told apart by their folder. None: a generated agentic trace. "
                        "Formats and the generator: docs/traces.md")
    p.add_argument("--synthetic", action="store_true",
                   help="also replay a generated agentic trace (the default when no TRACE is given)")
    p.add_argument("--seed", type=non_negative_int, default=None, help="seed of the generated trace (default 0)")
    p.add_argument("--sessions", type=positive_int, default=None,
                   help="conversations (sessions) in the generated trace (default 200)")
    p.add_argument("--block-tokens", type=int_between(1, MAX_BLOCK_TOKENS, "tokens a block"), default=None,
                   help="tokens a block when keying token-level traces and the generated trace, "
                        f"at most {MAX_BLOCK_TOKENS:,} (default 512; Mooncake traces are fixed at 512)")
    from kvtier.presets import LAYOUT_PRESETS as PRESETS
    p.add_argument("--layout", default=None, choices=list(PRESETS), metavar="PRESET",
                   help=f"KV layout ({', '.join(PRESETS)}): turns byte capacities such as 64GiB "
                        "into blocks and shows each capacity in bytes (default: none)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace_arguments(p)
    p.add_argument("--policy", default=DEFAULT_POLICIES, help=policy_help())
    p.add_argument("--capacity", default=DEFAULT_CAPACITIES, help=CAPACITY_HELP)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per (trace, policy, capacity) instead of tables")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also write prefix hit ratio against capacity as an image (.png, .pdf, .svg); "
                        "its folder must exist (default: no plot)")


def expand_policies(text: str) -> list[str]:
    """Policy names from the --policy list, 'all' and 'recommended' expanded, in order."""
    from kvtier.errors import ConfigError
    from kvtier.policies import DEFAULT_POLICY, known_policy, make_policy, policy_names, unknown_policy

    out: list[str] = []
    for name in (p.strip() for p in text.split(",") if p.strip()):
        names = [*policy_names(), "belady"] if name == "all" else [DEFAULT_POLICY if name == "recommended" else name]
        for n in names:
            if n.startswith("belady+"):
                raise ConfigError(f"policy {n!r}: belady is the offline bound and takes no admission "
                                  "filter; write 'belady'")
            if n != "belady":
                if not known_policy(n):       # named with what this command takes, belady and all too
                    raise unknown_policy(n, ("recommended", "belady", "all"))
                check_filters_once(n)
                make_policy(n, 1)
            if n not in out:
                out.append(n)
    if not out:
        raise ConfigError("--policy is empty: name at least one policy, e.g. lru,belady")
    return out


def check_filters_once(name: str) -> None:
    """Each admission filter at most once: 'lru+nopartial+nopartial' is the cache
    'lru+nopartial' under a second name, so a table would show it twice."""
    from kvtier.errors import ConfigError

    base, *rules = name.split("+")
    twice = [r for r in dict.fromkeys(rules) if rules.count(r) > 1]
    if twice:
        once = "+".join([base, *dict.fromkeys(rules)])
        raise ConfigError(f"policy {name!r} repeats +{twice[0]}: give each admission filter once, e.g. {once!r}")


def distinct_capacities(caps: list[Capacity]) -> list[Capacity]:
    """The capacities in order, each written form once ('5%,5%' is one capacity, as a
    policy named twice is one policy); '5%' and '0.05' stay two rows, as written."""
    seen: dict[str, Capacity] = {}
    for c in caps:
        seen.setdefault("".join(c.text.split()), c)
    return list(seen.values())


def block_bytes_of(args: argparse.Namespace) -> int | None:
    """Bytes of one block under --layout, or None."""
    if not args.layout:
        return None
    from kvtier.layout import preset_layout
    return preset_layout(args.layout, args.block_tokens or 512).block_bytes


def check_byte_capacities(caps: list, block_bytes: int | None) -> None:
    from kvtier.errors import ConfigError
    for c in caps:
        if c.nbytes is not None:
            if not block_bytes:
                raise ConfigError(f"capacity {c.text!r} is in bytes: give --layout (e.g. kimi-k2) so "
                                  "kvtier knows how many bytes one block takes")
            c.blocks_for(1, block_bytes)   # at least one block, or a ConfigError saying so


def check_plot_path(path: str) -> None:
    """Fail now, not after the replay, if the figure could never be written."""
    from kvtier.errors import ConfigError
    if not path:
        raise ConfigError("--plot needs a file name, e.g. --plot hit_ratio.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvtier[cli]', or leave --plot out") from None
    if os.path.isdir(path):
        raise ConfigError(f"--plot {path!r} is a folder: give a file name, e.g. {os.path.join(path, 'hit_ratio.png')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path!r}: folder {folder} does not exist: create it or give another path")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    kinds = plot_formats()
    if ext not in kinds:
        what = f".{ext}" if ext else "a file without an extension"
        why = f" (it needs LaTeX, and {_tex_program()} is not installed)" if ext in _LATEX_FORMATS else ""
        raise ConfigError(f"--plot {path!r}: cannot write {what}{why}; end the name in .png (or "
                          f"{', '.join('.' + k for k in kinds if k != 'png')})")
    why = _unwritable(path)     # last: it creates (and removes) the file
    if why:
        raise ConfigError(f"--plot {path!r} cannot be written ({why}): give a path you can write")


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written, or None: tried, not asked of os.access, which tells root
    yes where writing still fails (/proc). An existing file is opened to append (left as it
    is); a new one is created and removed again."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab" if existed else "xb"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.unlink(path)
    return None


_LATEX_FORMATS = ("pgf",)    # matplotlib writes these only with a TeX program installed


def _tex_program() -> str:
    """The TeX program matplotlib's pgf backend runs (xelatex unless configured otherwise)."""
    import matplotlib
    return str(matplotlib.rcParams["pgf.texsystem"])


def plot_formats() -> list[str]:
    """Extensions --plot can write here: matplotlib's, less those that need a TeX program
    that is not installed (.pgf failed only after the whole replay)."""
    import shutil

    from matplotlib.backend_bases import FigureCanvasBase

    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(_tex_program()) is None:
        kinds = [k for k in kinds if k not in _LATEX_FORMATS]
    return kinds


def load_traces(args: argparse.Namespace) -> list[Any]:
    """The traces named on the command line, then the generated one if asked (or if none)."""
    from kvtier.errors import ConfigError
    from kvtier.traces import AgenticConfig, read_trace, synthetic_name, synthetic_trace

    generated = args.synthetic or not args.trace
    if not generated and (args.seed is not None or args.sessions is not None):
        given = " and ".join(f for f, v in (("--seed", args.seed), ("--sessions", args.sessions)) if v is not None)
        verb = "shape" if " and " in given else "shapes"
        raise ConfigError(f"{given} {verb} the generated trace, which is not replayed when a TRACE is given: "
                          "add --synthetic to replay it too, or leave that out")
    from kvtier.progress import progress
    from kvtier.traces.read import distinct_inputs, trace_names

    cfg = AgenticConfig(seed=args.seed or 0, sessions=args.sessions or 200, block_tokens=args.block_tokens or 512)
    paths = distinct_inputs(args.trace)
    names = trace_names(paths, taken=[synthetic_name(cfg)] if generated else [])
    # A spinner: a large trace, or small blocks (--block-tokens 1: 26 M keys), take seconds
    # to read and key before the replay's own bar starts.
    with progress("reading and keying the traces", enabled=not getattr(args, "json", False)):
        traces = [read_trace(p, block_tokens=args.block_tokens, name=n) for p, n in zip(paths, names)]
        if generated:
            traces.append(synthetic_trace(cfg))
        empty = [tr for tr in traces if tr.unique_blocks == 0]
    for tr in empty:
        if tr.format == "mooncake":
            raise ConfigError(f"trace {tr.name} has no blocks (every request's hash_ids is empty): "
                              "nothing to replay; check that this is the trace you meant")
        raise ConfigError(f"trace {tr.name} has no full block of {tr.block_tokens} tokens (every "
                          "prompt is shorter), so nothing can be cached: give a smaller --block-tokens")
    return traces


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import replay_ticks
    from kvtier.bench.hit_ratio_report import Row, print_report
    from kvtier.errors import ConfigError
    from kvtier.progress import progress
    from kvtier.sim.capacity import parse_capacities
    from kvtier.sim.replay import replay

    policies = expand_policies(args.policy)
    caps = distinct_capacities(parse_capacities(args.capacity))
    if not caps:
        raise ConfigError(f"--capacity is empty: give e.g. {DEFAULT_CAPACITIES}")
    block_bytes = block_bytes_of(args)
    check_byte_capacities(caps, block_bytes)
    if args.plot is not None:
        check_plot_path(args.plot)
    traces = load_traces(args)
    runs: list[tuple[Any, list[Row]]] = []
    work = sum(len(t) for t in traces) * len(policies) * len(caps)
    with progress("replaying", work, enabled=not args.json) as bar:
        for tr in traces:
            rows: list[Row] = []
            runs.append((tr, rows))
            for cap in caps:
                asked = cap.blocks_for(tr.unique_blocks, block_bytes)
                at_cap: list[Row] = []
                for pol in policies:
                    bar.describe(f"{tr.name} {pol} {cap.text}")
                    with replay_ticks(bar, len(tr)) as tick:
                        r = replay(tr, pol, asked, progress=tick)
                    row = Row(cap.text, asked, r)
                    rows.append(row)
                    at_cap.append(row)
                if args.json:        # a capacity's rows together: "of bound" needs its belady row
                    bound = next((x.result.prefix_hit_ratio for x in at_cap if x.result.offline), None)
                    for row in at_cap:
                        r = row.result
                        of = round(r.prefix_hit_ratio / bound, 6) if bound and not r.offline else None
                        print(json.dumps({**r.to_json(), "capacity": cap.text, "capacity_clamped": row.clamped,
                                          "of_bound": of}), flush=True)
    if not args.json:
        print_report(runs, block_bytes)
    if args.plot:
        from kvtier.bench.hit_ratio_plot import plot
        plot([row.result for _tr, rows in runs for row in rows], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
