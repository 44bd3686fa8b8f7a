"""Multi-head Latent Attention (MLA) over a paged pool of cached latents, in the absorbed form.

Per token and layer MLA caches one `kv_lora_rank`-wide latent c = kv_a_layernorm(...)
and one `qk_rope_head_dim`-wide rope key k_pe shared by all heads: 576 numbers for
Kimi K2, instead of 2 x 64 heads x 128-192 for plain multi-head attention. The pool
row of a token is exactly [c, k_pe] (see kvtier.engine.batch), and it is the only KV.

The per-head keys and values are up-projections of the latent, k_nope_h = W_UK_h c and
v_h = W_UV_h c (W_UK, W_UV: the two halves of kv_b_proj). We never materialise them;
we "absorb" the up-projections instead:

    score_h(t, s) = q_nope_h(t) . (W_UK_h c_s) + q_pe_h(t) . k_pe_s
                  = [W_UK_h^T q_nope_h(t), q_pe_h(t)] . [c_s, k_pe_s]       (query absorbs W_UK)
    out_h(t)      = sum_s p_h(t, s) W_UV_h c_s = W_UV_h (sum_s p_h(t, s) c_s)  (W_UV after attention)

so attention is multi-query attention whose keys are the pool rows themselves and
whose values are their latent part: one gather of the pool, no per-head KV tensor.
We use this one form for prefill and decode alike, so every token (new or cached)
reads its KV from the pool and a cached prefix gives the same numbers as a computed one.

The trade-off: absorbed scores are dot products of kv_lora_rank + rope_dim (576) numbers
instead of qk_head_dim (192), and the weighted sum runs over 512-wide latents instead of
128-wide values: cheap for decode (few queries, memory-bound on reading the cache) but
3-4x the attention FLOPs of plain MHA for a long prefill.
A faster prefill would up-project the chunk's keys and values per head (plain MHA on
192/128-wide heads) while still writing only [c, k_pe] to the pool; it would give the
same result up to rounding. This reference engine keeps the single, simpler path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.config import ModelConfig
from kvtier.engine.model.norm import MLA_NORM_EPS, RMSNorm
from kvtier.engine.model.rope import apply_rope, softmax_scale


def write_kv(kv_pool: torch.Tensor, layer: int, seq: SeqSlice, positions: torch.Tensor,
             entries: torch.Tensor) -> None:
    """Store entries [n, kv_dim] of tokens at `positions` [n] into their pages of layer `layer`."""
    block_tokens = kv_pool.shape[2]
    pages = seq.pages.to(kv_pool.device)
    pos = positions.to(kv_pool.device)
    kv_pool[pages[pos // block_tokens], layer, pos % block_tokens] = entries.to(kv_pool.dtype)


def read_kv(kv_pool: torch.Tensor, layer: int, seq: SeqSlice, dtype: torch.dtype) -> torch.Tensor:
    """The sequence's cached rows of layer `layer`, positions 0..total-1: [total, kv_dim]."""
    block_tokens, kv_dim = kv_pool.shape[2], kv_pool.shape[3]
    n_pages = -(-seq.total // block_tokens)
    rows = kv_pool[seq.pages[:n_pages].to(kv_pool.device), layer]      # [n_pages, block_tokens, kv_dim]
    return rows.reshape(-1, kv_dim)[:seq.total].to(dtype)


class MLA(nn.Module):
    """One layer's attention. Parameter names are the hub's (`self_attn.q_a_proj.weight`, ...)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        h, qk = config.hidden_size, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        self.scale = softmax_scale(config)
        self.interleaved = config.rope_interleave

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                kv_pool: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the new tokens of every sequence) -> [T, hidden]; writes their KV to the pool."""
        t = x.shape[0]
        q = self._query(x).view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, self.interleaved)

        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, :self.rank])
        k_pe = apply_rope(compressed[:, self.rank:], cos, sin, self.interleaved)
        entries = torch.cat([latent, k_pe], dim=-1)                           # [T, rank + rope]

        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        query = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T, heads, rank + rope]

        out = x.new_empty(t, self.num_heads, self.rank)
        for seq in batch.seqs:
            rows = slice(seq.start, seq.start + seq.num_new)
            positions = batch.positions[rows]
            write_kv(kv_pool, self.layer, seq, positions, entries[rows])
            kv = read_kv(kv_pool, self.layer, seq, x.dtype)                   # [total, rank + rope]
            keys = kv.unsqueeze(0).expand(self.num_heads, -1, -1)
            values = kv[:, :self.rank].unsqueeze(0).expand(self.num_heads, -1, -1)
            if seq.mask is None and seq.num_new > 1:   # speed: once per step, not per layer
                seq.mask = torch.arange(seq.total, device=x.device)[None, :] <= positions.to(x.device)[:, None]
            o = F.scaled_dot_product_attention(query[rows].transpose(0, 1), keys, values,
                                               attn_mask=seq.mask, scale=self.scale)
            out[rows] = o.transpose(0, 1)
        attn = torch.einsum("thr,hvr->thv", out, w_uv).reshape(t, self.num_heads * self.v_dim)
        return self.o_proj(attn)
