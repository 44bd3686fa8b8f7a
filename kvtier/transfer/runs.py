"""Rows that move together: a copy between two row-indexed buffers, cut into runs where
both sides are consecutive. From a GPU each run is one DMA straight to or from the tier's
(pinned) slots, so no host staging buffer is needed; a tail-first chain of new blocks
lands in consecutive slots, so a save is usually a few runs."""
from __future__ import annotations

from typing import Sequence

import torch


def runs(src_rows: Sequence[int], dst_rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first src row, first dst row, length) covering every pair (src_rows[j], dst_rows[j]),
    ordered by src row; a run continues while both sides go up by one."""
    pairs = sorted(zip(src_rows, dst_rows))
    out: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_rows(src: torch.Tensor, src_rows: Sequence[int], dst: torch.Tensor, dst_rows: Sequence[int],
              non_blocking: bool = False) -> int:
    """dst[dst_rows[j]] = src[src_rows[j]] for every j, one copy per run; returns the runs."""
    todo = runs(src_rows, dst_rows)
    for s, d, n in todo:
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
    return len(todo)
