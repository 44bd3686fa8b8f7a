"""What `kvtier bench hit-ratio` prints for a person: per trace a header saying what the
trace is, a table (one row per capacity and policy, the best online policy marked, Belady
shown as the bound), notes on clamped capacities and on the recommended policy, and a
legend of the columns. Every line fits in 100 columns for the usual traces.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Sequence

from kvtier.sim.replay import ReplayResult
from kvtier.traces.model import Trace

BEST = "*"
BOUND_LABEL = "belady (bound)"
DIGITS = 4    # decimals of the ratios printed
WIDTH = 100   # every line printed fits a 100-column terminal

LEGEND = """\
How to read the table:
  capacity    the cache size asked for (--capacity)
  blocks      that size in cache blocks (each of the block tokens named above the table)
  % unique    blocks / the trace's unique blocks; 100% holds every block: an infinite cache
{bytes}  prefix hit  share of the trace's block references served from the cache, counting only each
              request's leading run of cached blocks (a prefix cache cannot use a block after a
              miss); higher is better
  token hit   the same share counted in prompt tokens: the prefill work the cache saves
{best}{bound}--json prints every row's figures (evictions and of_bound too) as one JSON object per row."""
LEGEND_BEST = "  *           the best online policy at that capacity (ties at the 4 decimals shown all marked)\n"
LEGEND_BOUND = """\
  belady      the offline bound (Belady's MIN evicts the block needed furthest in the future):
              no real cache can do better
  of bound    prefix hit / belady's prefix hit at the same capacity
"""


@dataclass(slots=True)
class Row:
    """One replay: the capacity as written, the blocks it asked for, and the result."""

    capacity: str
    asked_blocks: int
    result: ReplayResult

    @property
    def clamped(self) -> bool:
        """Asked for more than the trace's unique blocks: run as an infinite cache."""
        return self.asked_blocks > self.result.capacity_blocks


def describe_trace(tr: Trace) -> list[str]:
    """Two or three lines saying what the trace is, for a header."""
    kind = {"mooncake": f"Mooncake trace {tr.path}", "tokens": f"token-level trace {tr.path}",
            "synthetic": "generated agentic trace (kvtier.traces.synthetic)"}.get(tr.format, tr.format)
    who = f" in {tr.sessions:,} session{'s' if tr.sessions != 1 else ''}" if tr.sessions else ""
    inf = tr.infinite_hits / tr.block_refs if tr.block_refs else 0.0
    first = textwrap.wrap(f"Trace {tr.name}: {kind}", WIDTH, subsequent_indent="  ",
                          break_long_words=False, break_on_hyphens=False)
    return [*first,
            f"  {len(tr):,} request{'s' if len(tr) != 1 else ''}{who}; {tr.unique_blocks:,} unique blocks of {tr.block_tokens} "
            f"tokens, {tr.block_refs:,} block references",
            f"  prefix hit with an infinite cache (the most any policy can reach): {inf:.4f}"]


def _share(x: float) -> str:
    return f"{x:.1%}" if x >= 0.01 else f"{x:.2%}"


def _best(rows: Sequence[Row]) -> set[int]:
    """Indices (into rows) of the best online policy per capacity, when two or more compete."""
    best: set[int] = set()
    groups: dict[tuple[str, int], list[int]] = {}
    for i, row in enumerate(rows):
        if not row.result.offline:
            groups.setdefault((row.capacity, row.result.capacity_blocks), []).append(i)
    for idx in groups.values():
        if len({rows[i].result.policy for i in idx}) < 2:
            continue
        shown = {i: round(rows[i].result.prefix_hit_ratio, DIGITS) for i in idx}   # ties as printed
        top = max(shown.values())
        best.update(i for i in idx if shown[i] == top)
    return best


def table(rows: Sequence[Row], block_bytes: int | None) -> tuple[list[str], list[list[str]]]:
    """Head and cells of one trace's table."""
    from kvtier.units import format_bytes

    bound = {(r.capacity, r.result.capacity_blocks): r.result.prefix_hit_ratio
             for r in rows if r.result.offline}
    head = ["policy", "capacity", "blocks", "% unique", "prefix hit", "token hit"]
    if block_bytes:
        head.insert(4, "bytes")
    if bound:
        head.append("of bound")
    best = _best(rows)
    out = []
    for i, row in enumerate(rows):
        r = row.result
        hit = f"{BEST} {r.prefix_hit_ratio:.4f}" if i in best else f"{r.prefix_hit_ratio:.4f}"
        cells = [BOUND_LABEL if r.offline else r.policy, row.capacity, f"{r.capacity_blocks:,}",
                 _share(r.capacity_fraction), hit, f"{r.token_hit_ratio:.4f}"]
        if block_bytes:
            cells.insert(4, format_bytes(r.capacity_blocks * block_bytes))
        if bound:
            b = bound.get((row.capacity, r.capacity_blocks))
            cells.append("" if r.offline or not b else f"{r.prefix_hit_ratio / b:.1%}")
        out.append(cells)
    return head, out


def notes(tr: Trace, rows: Sequence[Row]) -> list[str]:
    """Lines under a trace's table: clamped capacities, and what the recommended policy does here."""
    from kvtier.policies import DEFAULT_POLICY

    out = []
    clamped = list(dict.fromkeys(r.capacity for r in rows if r.clamped))
    if clamped:
        out += textwrap.wrap(f"{', '.join(clamped)}: more than the trace's {tr.unique_blocks:,} unique "
                             f"blocks, so run as exactly {tr.unique_blocks:,} blocks: an infinite cache, "
                             "nothing is ever evicted", WIDTH, subsequent_indent="  ")
    by_pol: dict[str, dict[tuple[str, int], float]] = {}
    for r in rows:
        by_pol.setdefault(r.result.policy, {})[(r.capacity, r.result.capacity_blocks)] = r.result.prefix_hit_ratio
    if DEFAULT_POLICY not in by_pol:
        return out
    mine = by_pol[DEFAULT_POLICY]
    base, *rules = DEFAULT_POLICY.split("+")
    said = []
    if "nopartial" in rules and not tr.has_partial_blocks:
        said.append(f"the same as {base} here: this trace has no partial last block for +nopartial to "
                    "skip (kvtier keys full blocks only; Mooncake hash_ids include partial blocks, "
                    "where it differs)")
    elif base in by_pol and base != DEFAULT_POLICY:
        d = [mine[k] - v for k, v in by_pol[base].items() if k in mine]
        said.append(f"prefix hit {min(d):+.4f} to {max(d):+.4f} against {base} here")
    online = {p: hits for p, hits in by_pol.items() if p != "belady"}
    if len(online) > 1:
        worst = (0.0, DEFAULT_POLICY, "")
        for k, v in mine.items():              # from the figures as the table shows them
            top = max(online, key=lambda p: online[p].get(k, -1.0))
            gap = round(online[top][k], DIGITS) - round(v, DIGITS)
            if gap > worst[0]:
                worst = (gap, top, k[0])
        if round(worst[0], DIGITS) > 0:
            said.append(f"at most {worst[0]:.4f} below the best online policy shown ({worst[1]} at {worst[2]})")
        else:
            said.append("the best online policy shown at every capacity")
    head = f"recommended = {DEFAULT_POLICY} (the store's default, --policy recommended)"
    out += textwrap.wrap(f"{head}: {'; '.join(said)}" if said else head, WIDTH, subsequent_indent="  ")
    return out


def print_report(runs: Sequence[tuple[Trace, Sequence[Row]]], block_bytes: int | None) -> None:
    """Header, table and notes of each trace, then the legend, on stdout."""
    from kvtier.bench.common import print_table

    for tr, mine in runs:
        print("\n".join(describe_trace(tr)))
        head, cells = table(mine, block_bytes)
        print_table(f"{tr.name}: prefix hit ratio by capacity and policy", head, cells, left=1)
        for line in notes(tr, mine):
            print(line)
        print()
    # Only the lines for what the tables show: no `*` without two online policies to rank,
    # no belady or `of bound` without the offline bound among the policies.
    rows = [row for _, mine in runs for row in mine]
    print(LEGEND.format(bytes="  bytes       blocks x the bytes of one block of --layout\n" if block_bytes else "",
                        best=LEGEND_BEST if any(_best(mine) for _, mine in runs) else "",
                        bound=LEGEND_BOUND if any(r.result.offline for r in rows) else ""))
