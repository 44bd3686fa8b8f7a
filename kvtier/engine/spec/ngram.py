"""Prompt lookup (n-gram) proposer: tool calls and quotes repeat text already in the context.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier
in prompt + output; at the most recent earlier match, the tokens that followed it are the draft.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        total = len(tokens)
        if k < 1 or total < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # windows starting at 0..total-n-1: every earlier n-gram followed by at least one token
            hits = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
