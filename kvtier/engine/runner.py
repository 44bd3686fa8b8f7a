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
    """Steps 2 and 3 of the engine loop: a step's inputs as tensors (tokens, positions, page
    tables; a captured decode graph's where one fits), and the model run over them."""

    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_pool = kv_pool            # [slots, layers, block_tokens, width]: the device tier
        self.device = kv_pool.device
        self.graphs = graphs

    def prepare(self, scheduled: Sequence[Scheduled]) -> StepBatch | DecodeStep:
        """The step's inputs: a DecodeStep for a captured graph when every request decodes
        one token and the batch fits one, else a StepBatch (with each loading prefix's wait)."""
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
    want: list[int] = []
    pages_flat: list[int] = []
    spans: list[tuple[int, int, int, int]] = []          # (start, num_new, context, pages) per sequence
    for toks, context, pages, samples in seqs:
        start = len(ids)
        ids += toks
        pos += range(context, context + len(toks))
        spans.append((start, len(toks), context, len(pages)))
        pages_flat += pages
        if samples:
            want.append(len(ids) - 1)
    # Speed: the step's integers go to the device in one copy, cut into views there. On a GPU
    # each torch.tensor(list, device=cuda) is a pageable copy the host waits for: a prefill of
    # 16 sequences made 19 of them. (Not yet timed on a GPU.)
    flat = torch.tensor(ids + pos + want + pages_flat, dtype=torch.int64).to(device)
    t, w = len(ids), len(want)
    seqs_out: list[SeqSlice] = []
    at = 2 * t + w
    for start, n, context, n_pages in spans:
        seqs_out.append(SeqSlice(start, n, context, flat[at:at + n_pages]))
        at += n_pages
    return StepBatch(flat[:t], flat[t:2 * t], seqs_out, flat[2 * t:2 * t + w], before_layer)
