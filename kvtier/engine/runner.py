"""Steps 2 and 3 of the engine loop: turn the scheduled requests into one StepBatch, run the model.

The batch is flat: every request's new tokens back to back, each with its position and
its page list (device-tier slots). Logits are taken only where a request samples. A
prefix still being copied up from a lower tier is waited for layer by layer, so layer 0
computes while later layers arrive.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.scheduler import Scheduled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor) -> None:
        self.model = model
        self.kv_pool = kv_pool            # [slots, layers, block_tokens, width]: the device tier
        self.device = kv_pool.device

    def prepare(self, scheduled: Sequence[Scheduled]) -> StepBatch:
        ids: list[int] = []
        pos: list[int] = []
        seqs: list[SeqSlice] = []
        want: list[int] = []
        loads = [s.req.load for s in scheduled if s.req.load is not None]
        for s in scheduled:
            r, start = s.req, len(ids)
            ids += r.token_range(r.computed, r.computed + s.num_new)
            pos += range(r.computed, r.computed + s.num_new)
            seqs.append(SeqSlice(start, s.num_new, r.computed, torch.tensor(r.pages, dtype=torch.int64, device=self.device)))
            if s.samples:
                want.append(len(ids) - 1)

        def before_layer(layer: int) -> None:
            for load in loads:
                load.wait_for_layer(layer)

        dev = self.device
        return StepBatch(torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                         seqs, torch.tensor(want, dtype=torch.int64, device=dev), before_layer if loads else None)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [requests that sample, vocab] (fp32)."""
        return self.model(batch, self.kv_pool)
