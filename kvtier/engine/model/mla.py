"""Multi-head Latent Attention (MLA) over a paged pool of cached latents.

Per token and layer MLA caches one `kv_lora_rank`-wide latent c = kv_a_layernorm(...)
and one `qk_rope_head_dim`-wide rope key k_pe shared by all heads: 576 numbers for
Kimi K2, instead of 2 x 64 heads x 128-192 for plain multi-head attention. The pool
row of a token is exactly [c, k_pe] (see kvtier.engine.batch), and it is the only KV.

The per-head keys and values are up-projections of the latent, k_nope_h = W_UK_h c and
v_h = W_UV_h c (W_UK, W_UV: the two halves of kv_b_proj). Attention has two exact forms:

  up-projected: materialise k_h = [W_UK_h c_s, k_pe_s] and v_h = W_UV_h c_s for every key
      s, then plain multi-head attention on qk_head_dim (192) / v_head_dim (128) heads.
  absorbed:     score_h(t, s) = [W_UK_h^T q_nope_h(t), q_pe_h(t)] . [c_s, k_pe_s]
                out_h(t)      = W_UV_h (sum_s p_h(t, s) c_s)
      i.e. multi-query attention whose keys are the pool rows themselves (576 wide) and
      whose values are their latents (512 wide): no per-head key or value tensor.

FLOPs for n new tokens over T keys (context + n), H heads, r = kv_lora_rank, d_r = rope,
d_n = qk_nope, d_v = v_head_dim (multiply-adds x 2):

  up-projected   2 H T r (d_n + d_v)          (up-project every key and value)
               + 2 H n T (d_n + d_r + d_v)    (attention on small heads)
  absorbed       2 H n r (d_n + d_v)          (absorb W_UK into q, apply W_UV after)
               + 2 H n T (2 r + d_r)          (attention on 576 / 512-wide rows)

Kimi K2 (H 64, r 512, d_r 64, d_n = d_v = 128): up-projection costs 16.8 M x T for the
keys and 41 k x n x T for attention; absorbed costs 139 k x n x T. So one decode token
(n = 1) is ~120x cheaper absorbed, and a prefill chunk of n > ~170 tokens is cheaper
up-projected (4096 new tokens: 3.3x fewer FLOPs). `prefer_up_projected` makes this choice
per sequence and step from the formula above: prefill chunks go up-projected, decode and
short chunks after a long cached prefix (the cached-prefix case) stay absorbed. Both
forms read every key, new or cached, from the pool rows (written first), so a token's KV
is the same bytes whether it was computed now or loaded, and the two forms agree to
rounding (tests/test_engine_model.py checks both against transformers at 1e-4).

Both forms run once per layer for all the sequences of a step that chose them: one
gather of their pool rows, padded to a rectangle ([B, K]), with the causal mask built
from lengths (kvtier.engine.batch.attn_group), not per sequence. On a CPU in fp32 the
absorbed form skips that gather: the C kernel kvtier._mla reads each key row from the
pool where it lies, once, for every head (see _absorbed_paged).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.batch import AttnGroup, StepBatch, attn_group
from kvtier.engine.config import ModelConfig
from kvtier.engine.model.mlp import fuse_weights
from kvtier.engine.model.norm import MLA_NORM_EPS, RMSNorm
from kvtier.engine.model.rope import apply_rope, softmax_scale


# Tests set this to "absorbed" or "up" to check one form everywhere; None: cheaper by FLOPs.
FORCE_FORM: str | None = None

# The optional C kernel (kvtier/_mla.c, built by `pip install`): absorbed attention over the
# pages in place. Without it (no C compiler at install time) the torch ops compute the same.
try:
    from kvtier._mla import attend as _paged_attend
except ImportError:
    _paged_attend = None

# Tests set this to False to run the torch path where the kernel is built.
PAGED_KERNEL = True
_POOL: ThreadPoolExecutor | None = None       # splits the kernel's queries over torch's threads
_POOL_SIZE = 0


def prefer_up_projected(config: ModelConfig, num_new: int, total: int) -> bool:
    """Whether the up-projected form costs fewer FLOPs than the absorbed one for `num_new`
    new tokens over `total` keys (the table in this module's docstring)."""
    if FORCE_FORM is not None:
        return FORCE_FORM == "up"
    h, r, dr = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    dn, dv = config.qk_nope_head_dim, config.v_head_dim
    up = total * r * (dn + dv) + num_new * total * (dn + dr + dv)
    absorbed = num_new * r * (dn + dv) + num_new * total * (2 * r + dr)
    return up < absorbed


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
        self.config = config
        self.register_buffer("qkv_a", None, persistent=False)     # set by fuse()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                kv_pool: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (the new tokens of every sequence) -> [T, hidden]; writes their KV to the pool."""
        t = x.shape[0]
        q, compressed = self._project(x)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        # Speed: the heads' rope parts and the shared rope key rotate in one call.
        pe = torch.cat([q[..., self.nope:], compressed[:, None, self.rank:]], dim=1)      # [T, H + 1, rope]
        pe = apply_rope(pe, cos, sin, self.interleaved)
        q_nope, q_pe, k_pe = q[..., :self.nope], pe[:, :-1], pe[:, -1]
        latent = self.kv_a_layernorm(compressed[:, :self.rank])

        # Write first, then every form reads all its keys (new and cached) from the pool.
        # Speed: one index_copy_ for every token of the step (row indices built once per step).
        bt, width = kv_pool.shape[2], kv_pool.shape[3]
        flat = kv_pool.view(-1, width)
        flat.index_copy_(0, batch.write_rows(kv_pool) + self.layer * bt,
                         torch.cat([latent, k_pe], dim=-1).to(kv_pool.dtype))

        out = x.new_empty(t, self.num_heads * self.v_dim)
        q = None                                  # [T, H, qk]: joined only for the torch paths
        for form, group in self._groups(batch, kv_pool):
            if form == "absorbed" and use_paged_kernel(x, kv_pool, group, self.num_heads):
                o = self._absorbed_paged(q_nope, q_pe, flat, group, batch, self.layer * bt)   # [sequences, H * v]
                if group.dest is None:
                    out = o
                else:
                    out.index_copy_(0, group.dest, o)
                continue
            if q is None:
                q = torch.cat([q_nope, q_pe], dim=-1)
            rows = flat.index_select(0, (group.key_rows + self.layer * bt).view(-1))   # one gather per group
            rows = rows.view(*group.key_rows.shape, width).to(x.dtype)                # [B, K, rank + rope]
            o = self._up_projected(q, rows, group) if form == "up" else self._absorbed(q, rows, group)
            if group.dest is None:                # the group is every token, in order: no scatter
                out = o.reshape(t, -1)
            else:
                out.index_copy_(0, group.dest, o.view(-1, o.shape[-1]).index_select(0, group.src))
        return self.o_proj(out)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H * qk_head_dim], compressed kv [T, rank + rope]).

        Speed: q_proj (or q_a_proj) and kv_a_proj_with_mqa read the same x and run as one
        matmul over their weights concatenated (fuse(): views of one tensor, no extra memory)."""
        if self.qkv_a is not None:
            both = F.linear(x, self.qkv_a)
            if hasattr(self, "q_proj"):
                return both.split([self.q_proj.out_features, self.rank + self.rope], dim=-1)
            q_a, compressed = both.split([self.q_a_proj.out_features, self.rank + self.rope], dim=-1)
            return self.q_b_proj(self.q_a_layernorm(q_a)), compressed
        return self._query(x), self.kv_a_proj_with_mqa(x)

    def fuse(self) -> None:
        """Concatenate q_proj (or q_a_proj) and kv_a_proj_with_mqa into one weight; the two
        parameters become views of it (state_dict() and the hub names are unchanged)."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        self.qkv_a = fuse_weights(first, self.kv_a_proj_with_mqa)

    def _groups(self, batch: StepBatch, kv_pool: torch.Tensor) -> list[tuple[str, AttnGroup]]:
        """The step's sequences split by form, each group padded once per step (memoised);
        the batch's own groups where it fixed them (a static decode step)."""
        if batch.groups is not None:
            return batch.groups
        if "mla_groups" not in batch.memo:
            c = self.config
            forms: dict[str, list[int]] = {"absorbed": [], "up": []}
            for i, s in enumerate(batch.seqs):
                forms["up" if prefer_up_projected(c, s.num_new, s.total) else "absorbed"].append(i)
            batch.memo["mla_groups"] = [(f, attn_group(batch, idx, kv_pool)) for f, idx in forms.items() if idx]
        return batch.memo["mla_groups"]

    def _absorbed_paged(self, q_nope: torch.Tensor, q_pe: torch.Tensor, flat: torch.Tensor, g: AttnGroup,
                        batch: StepBatch, offset: int) -> torch.Tensor:
        """The absorbed form with kvtier._mla, one query per sequence: [B, H * v] (g's order).

        Speed: the torch path copies every key row of the group into a padded [B, K, 576]
        tensor, then two batched matmuls read that copy twice; the kernel reads each row
        once from the pool, for all heads (batch-16 decode here: attention ~2x faster,
        the whole step ~1.3x). Costs a C kernel (fp32, CPU) next to the torch path it
        replaces, and sums in another order (fp32 rounding, well inside 1e-4)."""
        w_uk, w_uv = self._w_uk_uv()
        rows, lens = paged_inputs(batch, g)
        if g.dest is not None:                                                    # the group's tokens
            q_nope, q_pe = q_nope[g.dest], q_pe[g.dest]
        n, h = q_nope.shape[0], self.num_heads
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)                  # [N, H, rank]
        query = torch.cat([q_lat, q_pe], dim=-1)                                         # [N, H, rank + rope]
        latent_out = query.new_empty(n, h, self.rank)
        attend_paged(latent_out, query, batch, flat, rows, lens, offset, self.scale)
        out = torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2))              # [H, N, v]
        return out.transpose(0, 1).reshape(n, h * self.v_dim)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _up_projected(self, q: torch.Tensor, rows: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        """Prefill: per-head keys and values from the latents, then torch's SDPA. [B, Q, H * v]"""
        b, k = rows.shape[:2]
        h = self.num_heads
        kv = self.kv_b_proj(rows[..., :self.rank]).view(b, k, h, self.nope + self.v_dim)
        keys = torch.cat([kv[..., :self.nope], rows[:, :, None, self.rank:].expand(b, k, h, self.rope)], dim=-1)
        query = q[g.tokens].transpose(1, 2)                                          # [B, H, Q, qk]
        values = kv[..., self.nope:]
        qk = self.nope + self.rope
        if self.v_dim < qk:
            # Speed: torch's fused CPU attention kernel (flash) needs v as wide as q and k; with
            # a narrower v SDPA falls back to the unfused math path (scores materialised, ~4x
            # slower at 1k tokens here). Zero-padding v costs (qk - v) / qk of wasted PV FLOPs.
            values = F.pad(values, (0, qk - self.v_dim))
        mask = None if g.causal_from_zero else g.mask[:, None]     # causal from zero: no mask tensor
        o = F.scaled_dot_product_attention(query, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                           is_causal=g.causal_from_zero, scale=self.scale)[..., :self.v_dim]
        return o.transpose(1, 2).reshape(b, -1, h * self.v_dim)

    def _absorbed(self, q: torch.Tensor, rows: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        """Decode: multi-query attention over the pool rows, the heads folded into the query
        rows of one batched matmul per sequence. [B, Q, H * v]"""
        w_uk, w_uv = self._w_uk_uv()                     # [H, nope, rank], [H, v, rank]: views of kv_b_proj
        b, n = g.tokens.shape
        h = self.num_heads
        qg = q[g.tokens].view(b * n, h, -1)                                         # [B*Q, H, qk]
        # W_UK_h^T q_nope_h per head: one bmm over heads (speed: einsum's planning and permute
        # copies cost more than the matmul at decode sizes).
        q_lat = torch.bmm(qg[..., :self.nope].transpose(0, 1), w_uk).transpose(0, 1)   # [B*Q, H, rank]
        query = torch.cat([q_lat, qg[..., self.nope:]], dim=-1).view(b, n * h, -1)      # [B, Q*H, rank + rope]
        scores = torch.bmm(query, rows.transpose(1, 2)) * self.scale                   # [B, Q*H, K]
        if g.mask is not None:                                                       # [B, Q, K] -> every head
            scores = scores.view(b, n, h, -1).masked_fill_(~g.mask[:, :, None], float("-inf")).view(b, n * h, -1)
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(rows.dtype)
        latent_out = torch.bmm(p, rows[..., :self.rank]).view(b * n, h, self.rank)
        out = torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2))           # [H, B*Q, v]: W_UV after attention
        return out.transpose(0, 1).reshape(b, n, h * self.v_dim)


# Speed: the kernel reads each key row once per query and 4 heads, at a fraction of a BLAS
# matmul's FLOP rate; it wins where the rows are the cost (decode: one query per sequence,
# few heads: 2x at 4 heads, 1.3-1.5x at 16 measured here). Several queries per sequence (a
# chunk after a cached prefix, speculative verification) or many heads make the torch
# path's matmuls efficient (the first token of a 16-token chunk after 1,008 cached tokens
# took 0.028-0.031 s with the kernel, 0.018-0.020 s without), so those stay there.
PAGED_MAX_HEADS = 16


def use_paged_kernel(x: torch.Tensor, kv_pool: torch.Tensor, g: AttnGroup, heads: int) -> bool:
    """Whether the absorbed form runs in kvtier._mla: built, a CPU pool, fp32 throughout, one
    query per sequence, at most PAGED_MAX_HEADS heads."""
    return (PAGED_KERNEL and _paged_attend is not None and kv_pool.device.type == "cpu"
            and kv_pool.dtype == torch.float32 and x.dtype == torch.float32
            and g.tokens.shape[1] == 1 and heads <= PAGED_MAX_HEADS)


def paged_inputs(batch: StepBatch, g: AttnGroup) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64 [B, K], lens int64 [B]) for kvtier._mla, one query per sequence: each
    sequence's layer-0 key rows and how many of them it has. Once per step and group (memo),
    shared by every layer."""
    key = ("mla_paged", id(g))
    if key not in batch.memo:
        rows = g.key_rows
        if g.mask is None:                                   # every sequence has K keys
            lens = torch.full((rows.shape[0],), rows.shape[1], dtype=torch.int64)
        else:                                                # [B, 1, K]: a prefix of each row
            lens = g.mask.sum(-1).view(-1)
        batch.memo[key] = (rows.contiguous().numpy(), lens.numpy())
    return batch.memo[key]


def attend_paged(out: torch.Tensor, query: torch.Tensor, batch: StepBatch, flat: torch.Tensor, rows: np.ndarray,
                 lens: np.ndarray, offset: int, scale: float) -> None:
    """kvtier._mla.attend into out [N, H, rank]; with several torch threads, the queries are
    split over that many threads (the kernel releases the GIL)."""
    global _POOL, _POOL_SIZE
    n, h, width = query.shape
    rank = out.shape[-1]
    if "mla_pool" not in batch.memo:                      # the pool's memory as numpy, once per step
        batch.memo["mla_pool"] = flat.view(-1).numpy()
    pool, q, o = batch.memo["mla_pool"], query.numpy(), out.numpy()
    threads = min(torch.get_num_threads(), n)
    if threads <= 1:
        _paged_attend(o, q, pool, rows, lens, offset, h, width, rank, scale)
        return
    if _POOL_SIZE < threads:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL, _POOL_SIZE = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-mla"), threads
    cuts = np.linspace(0, n, threads + 1).astype(int)
    jobs = [_POOL.submit(_paged_attend, o[a:b], q[a:b], pool, rows[a:b], lens[a:b], offset, h, width, rank, scale)
            for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    for j in jobs:
        j.result()
