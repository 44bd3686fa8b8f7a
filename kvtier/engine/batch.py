"""One forward step's inputs: the flat tokens of every scheduled sequence and where their KV lives.

The runner builds a StepBatch from the scheduler's decisions; the model reads it and
nothing else. KV lives in kvtier's device tier, viewed as

    kv_pool: [slots, num_layers, block_tokens, kv_lora_rank + rope_dim]   (the KV dtype)

so a page is one kvtier block (one device-tier slot) and a cached prefix found in the
device tier is used where it is, with no copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SeqSlice:
    """One sequence's share of a step: `num_new` tokens after `context` cached ones."""

    start: int               # offset of its first new token in StepBatch.input_ids
    num_new: int             # tokens computed this step (a prefill chunk, or 1 when decoding)
    context: int             # tokens whose KV is already in its pages (positions 0..context-1)
    pages: torch.Tensor      # int64 [ceil((context + num_new) / block_tokens)] slots, in token order
    # Which keys each new token sees (causal), the same in every layer: built by the first
    # layer that needs it. None when decoding one token: it sees every key.
    mask: torch.Tensor | None = field(default=None, repr=False)

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
