"""One forward step's inputs: the flat tokens of every scheduled sequence and where their KV lives.

The runner builds a StepBatch from the scheduler's decisions; the model reads it and
nothing else. KV lives in kvtier's device tier, viewed as

    kv_pool: [slots, num_layers, block_tokens, kv_lora_rank + rope_dim]   (the KV dtype)

so a page is one kvtier block (one device-tier slot) and a cached prefix found in the
device tier is used where it is, with no copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class SeqSlice:
    """One sequence's share of a step: `num_new` tokens after `context` cached ones."""

    start: int               # offset of its first new token in StepBatch.input_ids
    num_new: int             # tokens computed this step (a prefill chunk, or 1 when decoding)
    context: int             # tokens whose KV is already in its pages (positions 0..context-1)
    pages: torch.Tensor      # int64 [ceil((context + num_new) / block_tokens)] slots, in token order

    @property
    def total(self) -> int:
        return self.context + self.num_new


@dataclass
class StepBatch:
    """The flat inputs of one forward pass over several sequences."""

    input_ids: torch.Tensor           # int64 [T], the new tokens of every sequence, back to back
    positions: torch.Tensor           # int64 [T], each token's position in its sequence
    seqs: list[SeqSlice]
    logits_index: torch.Tensor        # int64 [B]: rows of the flat tokens whose logits are wanted
    # Called with layer i before layer i reads the pool: waits for a layer-wise load from a
    # lower tier (kvtier.transfer.LayerLoader) so layer 0 computes while later layers arrive.
    before_layer: Callable[[int], None] | None = None
    # The attention groups, fixed by whoever built the batch (decode_batch: one absorbed group
    # of static shape); None: the attention splits the sequences by form itself.
    groups: list[tuple[str, AttnGroup]] | None = None
    # Per-step values every layer shares (page indices, masks, the attention groups): built
    # by the first layer that needs them, reused by the others. Speed: once per step, not per layer.
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def write_rows(self, kv_pool: torch.Tensor) -> torch.Tensor:
        """int64 [T]: each new token's row in kv_pool viewed as [slots * layers * block_tokens, width],
        for layer 0 (add layer * block_tokens for another layer)."""
        if "write_rows" not in self.memo:
            bt, layers, dev = kv_pool.shape[2], kv_pool.shape[1], kv_pool.device
            order = sorted(range(len(self.seqs)), key=lambda i: self.seqs[i].start)
            pages = page_table([self.seqs[i] for i in order], dev)                # [S, P], by start
            starts = torch.tensor([self.seqs[i].start for i in order], device=dev)
            pos = self.positions.to(dev)
            seq_of = torch.searchsorted(starts, torch.arange(pos.shape[0], device=dev), right=True) - 1
            self.memo["write_rows"] = pages[seq_of, pos // bt] * (layers * bt) + pos % bt
        return self.memo["write_rows"]


@dataclass
class AttnGroup:
    """Several sequences' attention inputs padded to one rectangle: B sequences, at most Q new
    tokens and K keys each. Built with tensor ops from the sequences' lengths and page lists
    (no Python loop per token or per layer); padding repeats a real row and is masked out."""

    seq_index: list[int]         # which of StepBatch.seqs
    tokens: torch.Tensor         # int64 [B, Q]: each query's row in the flat batch (padding: the last real one)
    valid: torch.Tensor          # bool [B, Q]: real queries
    key_rows: torch.Tensor       # int64 [B, K]: each key position's pool row for layer 0 (padding: the last real one)
    mask: torch.Tensor | None    # bool [B, Q, K]: query may see key (causal; None: every key, one query each)
    causal_from_zero: bool       # no sequence has context: is_causal will do (queries and keys are the same
                                 # positions; a padded key is past every real query of its row), no mask
    dest: torch.Tensor | None    # int64 [N]: flat rows of the real queries (None: the group is rows 0..T-1 as [B*Q])
    src: torch.Tensor | None     # int64 [N]: their index in the padded [B * Q]


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, pages: torch.Tensor,
                 kv_pool: torch.Tensor) -> StepBatch:
    """A step of one new token per sequence, built from tensors alone: no Python per sequence
    and no read back to the host, so its shapes are fixed by the inputs' and it can be
    captured as a CUDA graph (kvtier.engine.graphs). input_ids and positions [B], pages
    [B, P] (each row the sequence's pages, padded with any page: only pages up to the one
    holding its position are read); every sequence attends to keys 0..position."""
    dev, bt, layers = kv_pool.device, kv_pool.shape[2], kv_pool.shape[1]
    b, keys = input_ids.shape[0], pages.shape[1] * bt
    kpos = torch.arange(keys, device=dev)
    key_rows = pool_rows(pages, torch.minimum(kpos[None, :], positions[:, None]), bt, layers)   # [B, K]
    mask = (kpos[None, :] <= positions[:, None])[:, None, :]                          # [B, 1, K]
    write = pool_rows(pages, positions[:, None], bt, layers).view(-1)
    rows = torch.arange(b, device=dev)
    group = AttnGroup(list(range(b)), rows[:, None], torch.ones(b, 1, dtype=torch.bool, device=dev), key_rows, mask,
                      False, None, None)
    return StepBatch(input_ids, positions, [], rows, groups=[("absorbed", group)], memo={"write_rows": write})


def pool_rows(pages: torch.Tensor, pos: torch.Tensor, bt: int, layers: int) -> torch.Tensor:
    """Layer 0's row in the pool (viewed as [slots * layers * bt, width]) of token position
    pos[i, j] of the sequence whose pages are pages[i]."""
    return pages.gather(1, pos // bt) * (layers * bt) + pos % bt


def page_table(seqs: list[SeqSlice], device: torch.device) -> torch.Tensor:
    """int64 [S, max pages]: the sequences' page lists, zero-padded."""
    return torch.nn.utils.rnn.pad_sequence([s.pages.to(device) for s in seqs], batch_first=True)


def attn_group(batch: StepBatch, index: list[int], kv_pool: torch.Tensor) -> AttnGroup:
    """The padded attention inputs of batch.seqs[i] for i in index."""
    seqs = [batch.seqs[i] for i in index]
    dev, bt, layers = kv_pool.device, kv_pool.shape[2], kv_pool.shape[1]
    start = torch.tensor([s.start for s in seqs], device=dev)
    ctx = torch.tensor([s.context for s in seqs], device=dev)
    nnew = torch.tensor([s.num_new for s in seqs], device=dev)
    total = ctx + nnew
    q_max, k_max = max(s.num_new for s in seqs), max(s.total for s in seqs)
    qi = torch.minimum(torch.arange(q_max, device=dev)[None, :], nnew[:, None] - 1)       # [B, Q]
    kpos = torch.arange(k_max, device=dev)
    kp = torch.minimum(kpos[None, :], total[:, None] - 1)                                 # [B, K]
    pages = page_table(seqs, dev)
    key_rows = pool_rows(pages, kp, bt, layers)
    if q_max == 1:
        mask = None if bool((total == k_max).all()) else (kpos[None, None, :] < total[:, None, None])
    else:
        mask = kpos[None, None, :] <= (ctx[:, None] + qi)[:, :, None]                    # causal, [B, Q, K]
    tokens = start[:, None] + qi
    valid = torch.arange(q_max, device=dev)[None, :] < nnew[:, None]
    dest = src = None
    n_tokens = batch.input_ids.shape[0]
    if not (len(seqs) * q_max == n_tokens == sum(s.num_new for s in seqs)
            and bool((tokens.view(-1) == torch.arange(n_tokens, device=dev)).all())):
        src = valid.view(-1).nonzero().view(-1)
        dest = tokens.view(-1)[src]
    return AttnGroup(index, tokens, valid, key_rows, mask, all(s.context == 0 for s in seqs), dest, src)
