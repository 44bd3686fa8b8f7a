"""MTP proposer: the checkpoint's own next-token-prediction layer (DeepSeek-V3) drafts tokens.

The MTP layer at position i reads the target's final hidden state at i and the embedding of
token i + 1, and predicts token i + 2. Its KV is layer N of the target's own pages (the
model is built with mtp=True, the layout has N + 1 layers), so it is paged, preempted,
cached and loaded with the target's blocks and needs no store of its own.

Each step, after the target's tokens are accepted (`after_step`, before the step's full
blocks are published), the layer runs over every position the target computed in that
step, with the target's hidden states: the MTP KV of every computed token is written before
its block can be cached, and is never written from a rejected token. For a decoding request
the last row gives d1 and the layer's own hidden state; at the next step's start
(`propose_requests`) the layer runs k - 1 positions ahead on its own outputs for d2..dk.
Those positions lie past `computed`: the next after_step overwrites them with the target's.

A block's MTP KV at its last position depends on the first token of the next block: a
prefix found in the cache may carry the MTP KV of another continuation there. That can only
make a proposal worse, never an output different (the target verifies every draft).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from kvtier.engine.request import Request
from kvtier.engine.runner import build_batch
from kvtier.engine.spec.draft import pick_drafts

if TYPE_CHECKING:
    from kvtier.engine.llm import LLM


class MTPProposer:
    """Proposes with the target model's MTP layer; needs the target's hidden states each step."""

    wants_hidden = True                    # the engine returns every new token's hidden state

    def __init__(self, target: LLM) -> None:
        self.model = target.model
        self.pool = target.runner.kv_pool
        self.scheduler = target.scheduler
        self.device = target.runner.device
        # request id -> (logits row giving d1, the MTP layer's hidden state at the last position)
        self.ahead: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def after_step(self, steps: Sequence[tuple[Request, int, int]], hidden: torch.Tensor) -> None:
        """Write the MTP KV of the positions the target computed this step. steps: (request,
        its first row in `hidden`, its computed count before the step); the request's
        `computed` is already the accepted count and its output holds the new tokens."""
        items, prev, live = [], [], []
        for r, row, old in steps:
            n = r.computed - old
            if n <= 0:
                continue
            decoding = r.finish_reason is None and r.computed == r.num_tokens - 1
            items.append((r.token_range(old + 1, r.computed + 1), old, r.pages, decoding))
            prev.append(hidden[row:row + n])
            if decoding:
                live.append((r, len(items) - 1))
        if not items:
            return
        batch = build_batch(items, self.device)
        logits, x = self.model.forward_mtp(batch, self.pool, torch.cat(prev))
        for i, (r, seq) in enumerate(live):
            s = batch.seqs[seq]
            self.ahead[r.id] = (logits[i], x[s.start + s.num_new - 1])

    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> None:
        """d1 from the last after_step, then d2..dk by running the layer ahead on its own outputs."""
        live, rows, hid = [], [], []
        for r, k in zip(reqs, ks):
            r.draft, r.draft_probs = [], None
            state = self.ahead.pop(r.id, None)
            # Pages for the verify step's 1 + k tokens now: the layer writes k - 1 of them ahead.
            if state is None or k < 1 or not self.scheduler.grow(r, 1 + k):
                continue
            live.append((r, k))
            rows.append(state[0])
            hid.append(state[1])
        if not live:
            return
        probs: dict[str, list[torch.Tensor]] = {r.id: [] for r, _ in live}
        pick_drafts([r for r, _ in live], torch.stack(rows), probs)
        h = torch.stack(hid)
        for j in range(1, max(k for _, k in live)):
            keep = [i for i, (_, k) in enumerate(live) if k > j]
            step = [live[i][0] for i in keep]
            batch = build_batch([([r.draft[-1]], r.computed + j - 1, r.pages, True) for r in step], self.device)
            logits, x = self.model.forward_mtp(batch, self.pool, h[keep])
            pick_drafts(step, logits, probs)
            h = torch.zeros_like(h)
            h[keep] = x
        for r, _ in live:
            if probs[r.id]:
                r.draft_probs = torch.stack(probs[r.id])

    def release(self, req: Request) -> None:
        self.ahead.pop(req.id, None)

    def close(self) -> None:
        self.ahead.clear()
