"""Steps 2 and 3 of the engine loop: turn the scheduled requests into one StepBatch, run the model.

The batch is flat: every request's new tokens back to back, each with its position and
its page list (device-tier slots). Logits are taken only where a request samples. A
prefix still being copied up from a lower tier is waited for layer by layer, so layer 0
computes while later layers arrive.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.scheduler import Scheduled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor) -> None:
        self.model = model
        self.kv_pool = kv_pool            # [slots, layers, block_tokens, width]: the device tier
        self.device = kv_pool.device

    def prepare(self, scheduled: Sequence[Scheduled]) -> StepBatch:
        loads = [s.req.load for s in scheduled if s.req.load is not None]

        def before_layer(layer: int) -> None:
            for load in loads:
                load.wait_for_layer(layer)

        return build_batch([(s.req.token_range(s.req.computed, s.req.computed + s.num_new), s.req.computed,
                             s.req.pages, s.samples) for s in scheduled], self.device,
                           before_layer if loads else None)

    @torch.inference_mode()
    def run(self, batch: StepBatch, hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [requests that sample, vocab] (fp32); hidden=True: (logits, every new token's final hidden state)."""
        return self.model(batch, self.kv_pool, hidden) if hidden else self.model(batch, self.kv_pool)


def build_batch(seqs: Sequence[tuple[Sequence[int], int, Sequence[int], bool]], device: torch.device,
                before_layer: Callable[[int], None] | None = None) -> StepBatch:
    """One StepBatch from (new token ids, position of the first, page list, wants logits) per
    sequence: the target's step and a draft model's steps are built by this one function."""
    ids: list[int] = []
    pos: list[int] = []
    seqs_out: list[SeqSlice] = []
    want: list[int] = []
    for toks, context, pages, samples in seqs:
        start = len(ids)
        ids += toks
        pos += range(context, context + len(toks))
        seqs_out.append(SeqSlice(start, len(toks), context, torch.tensor(pages, dtype=torch.int64, device=device)))
        if samples:
            want.append(len(ids) - 1)
    return StepBatch(torch.tensor(ids, dtype=torch.int64, device=device),
                     torch.tensor(pos, dtype=torch.int64, device=device), seqs_out,
                     torch.tensor(want, dtype=torch.int64, device=device), before_layer)
