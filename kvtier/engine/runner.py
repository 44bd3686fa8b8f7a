"""Steps 2 and 3 of the engine loop: turn the scheduled requests into one StepBatch, run the model.

The batch is flat: every request's new tokens back to back, each with its position and
its page list (device-tier slots). Logits are taken only where a request samples. A
prefix still being copied up from a lower tier is waited for layer by layer, so layer 0
computes while later layers arrive. With `graphs` (kvtier.engine.graphs), a step in which
every request decodes one token is a DecodeStep instead, replayed as a CUDA graph.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.graphs import DecodeGraphs, DecodeStep
from kvtier.engine.scheduler import Scheduled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_pool = kv_pool            # [slots, layers, block_tokens, width]: the device tier
        self.device = kv_pool.device
        self.graphs = graphs

    def prepare(self, scheduled: Sequence[Scheduled]) -> StepBatch | DecodeStep:
        if self.graphs is not None and self.graphs.usable and _decode_only(scheduled, self.graphs.max_batch):
            bt = self.kv_pool.shape[2]
            return DecodeStep([s.req.token_range(s.req.computed, s.req.computed + 1)[0] for s in scheduled],
                              [s.req.computed for s in scheduled],
                              [s.req.pages[:s.req.computed // bt + 1] for s in scheduled])
        loads = [s.req.load for s in scheduled if s.req.load is not None]

        def before_layer(layer: int) -> None:
            for load in loads:
                load.wait_for_layer(layer)

        return build_batch([(s.req.token_range(s.req.computed, s.req.computed + s.num_new), s.req.computed,
                             s.req.pages, s.samples) for s in scheduled], self.device,
                           before_layer if loads else None)

    @torch.inference_mode()
    def run(self, batch: StepBatch | DecodeStep,
            hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [requests that sample, vocab] (fp32); hidden=True: (logits, every new token's final hidden state)."""
        if isinstance(batch, DecodeStep):
            assert self.graphs is not None and not hidden, "a DecodeStep comes only from graphs, without hidden states"
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
            batch = build_batch([([t], p, pages, True) for t, p, pages in
                                 zip(batch.token_ids, batch.positions, batch.pages)], self.device)
        return self.model(batch, self.kv_pool, hidden) if hidden else self.model(batch, self.kv_pool)


def _decode_only(scheduled: Sequence[Scheduled], max_batch: int) -> bool:
    """Every request computes its one newest token and samples after it, with no prefix load
    in flight (a load is waited for between layers, which a graph cannot do) and no drafts."""
    return 0 < len(scheduled) <= max_batch and all(
        s.num_new == 1 and s.samples and s.req.load is None and not s.req.draft for s in scheduled)


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
