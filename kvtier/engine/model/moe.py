"""DeepSeek-V3's Mixture-of-Experts FFN: a sigmoid router with grouped top-k, routed and shared experts.

Routing ("noaux_tc"), per token, in fp32:
1. scores = sigmoid(x @ gate.weight^T), one per routed expert;
2. for *selection only*, add e_score_correction_bias (the load-balancing bias learned
   without an auxiliary loss);
3. split the experts into n_group groups, score each group by the sum of its top-2
   biased scores, keep the best topk_group groups;
4. pick the num_experts_per_tok best biased scores among the kept groups' experts;
5. weight each pick by its *un-biased* score, normalised to sum 1 if norm_topk_prob,
   times routed_scaling_factor.
The output is sum(weight_e * expert_e(x)) + shared_experts(x).

Speed: the experts' weights are stacked once at load (fuse(): w_gate_up [E, 2 I, H],
w_down [E, H, I]; each expert's parameters become views, so no memory is added), the
step's (token, expert) pairs are sorted by expert, and each projection is one grouped
matmul over the sorted rows (torch._grouped_mm where this torch has it, else one matmul
per *active* expert), never a loop per token. The shared expert is fused into the same
grouped matmuls as one more "expert" that every token visits with weight 1: one launch
fewer per projection, and for decode (a handful of rows) launches are the cost.

A step of very few tokens for few, small experts (T x experts <= DENSE_MAX_ROWS and the
stacked experts <= DENSE_MAX_BYTES: decode with kimi-tiny-sized MoEs, never Kimi K2's)
skips the sorting and runs every expert on every token, zero-weighted where not routed
(`_dense`). Each token's routed outputs are summed in a fixed order, not added with
atomics, so a step gives the same bits every time it runs (bf16 included).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.config import ModelConfig
from kvtier.engine.model.mlp import MLP, swiglu


# Speed: at most this many (token, expert) rows, every expert runs on every token (_dense):
# ~12 ops instead of ~25 (sort, count, gather, two grouped matmuls, scatter-add). Costs
# (experts + 1) / (top_k + 1) times the expert FLOPs and reads every expert's weights, which
# for so few rows is less than the ops saved: one MoE layer of the benchmark's 8-expert model
# 740 against 943 us at 16 tokens; the whole decode forward 2-3% faster at batch 1 and 16.
# At 32 tokens the two paths were even, so the bound is 256 rows.
DENSE_MAX_ROWS = 256
# ... and only where reading every expert costs less than the ~13 launches saved (a few us
# each): kimi-medium's experts are 5.3 GiB a layer, and its decode at batch 1 read all 65
# for the 9 a token visits: 7.5 ms a step on an H200 with CUDA graphs (session 13), about
# what reading 5 x 5.3 GiB takes there. 64 MiB is ~15 us of an H200's bandwidth.
DENSE_MAX_BYTES = 64 << 20


class Router(nn.Module):
    """The gate: hub names `mlp.gate.weight` and `mlp.gate.e_score_correction_bias`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        # kept in fp32 whatever the model's dtype (as transformers does)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, k] int64, weights [T, k] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        t, e = biased.shape
        if self.topk_group >= self.n_group:      # every group kept (Kimi K2: one group): plain top-k
            ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
            return self._weights(scores, ids)
        group_scores = biased.view(t, self.n_group, e // self.n_group).topk(2, dim=-1).values.sum(-1)
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept_groups, 1.0).bool()
        expert_mask = group_mask.repeat_interleave(e // self.n_group, dim=1)
        ids = biased.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
        return self._weights(scores, ids)

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class MoE(nn.Module):
    """Routed experts (one MLP each, as the hub stores them) plus the shared expert(s)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)
        # Set by fuse(): every expert's weights stacked (+ the shared expert's, as one more
        # expert when its width matches, which it does when n_shared_experts is 1).
        self.register_buffer("w_gate_up", None, persistent=False)
        self.register_buffer("w_down", None, persistent=False)
        self.shared_fused = False

    def fuse(self) -> None:
        mlps = list(self.experts)
        inter = mlps[0].gate_proj.weight.shape[0]
        if self.shared_experts is not None and self.shared_experts.gate_proj.weight.shape[0] == inter:
            mlps.append(self.shared_experts)
            self.shared_fused = True
        elif self.shared_experts is not None:
            self.shared_experts.fuse()
        self.w_gate_up = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach() for m in mlps])
        self.w_down = torch.stack([m.down_proj.weight.detach() for m in mlps])
        for i, m in enumerate(mlps):            # the hub-named parameters become views: no second copy
            m.gate_proj.weight = nn.Parameter(self.w_gate_up[i, :inter], requires_grad=False)
            m.up_proj.weight = nn.Parameter(self.w_gate_up[i, inter:], requires_grad=False)
            m.down_proj.weight = nn.Parameter(self.w_down[i], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        if self.w_gate_up is None:
            return self._loop(x, ids, weights)
        t, k = ids.shape
        if (t * self.w_gate_up.shape[0] <= DENSE_MAX_ROWS and self._stacked_bytes() <= DENSE_MAX_BYTES) \
                or (_capturing(x) and not _graph_grouped_mm(x)):
            # (while a CUDA graph is captured, only a grouped matmul that reads nothing back to
            # the host can run: else every expert on every token, as for few rows)
            return self._dense(x, ids, weights)
        if self.shared_fused:                   # the shared expert: id E, weight 1, for every token
            shared = torch.full((t, 1), len(self.experts), dtype=ids.dtype, device=ids.device)
            ids = torch.cat([ids, shared], dim=1)
            weights = torch.cat([weights, weights.new_ones(t, 1)], dim=1)
            k += 1
        flat = ids.flatten()
        order = flat.argsort(stable=True)                    # (token, slot) pairs grouped by expert
        # Not torch.bincount: on a GPU it reads the largest id back to size its output, a
        # host sync that a CUDA graph cannot hold (kvtier.engine.graphs).
        counts = flat.new_zeros(self.w_gate_up.shape[0]).scatter_add_(0, flat, torch.ones_like(flat))
        rows = x[order // k]                                 # [t * k, H], sorted by expert
        h = swiglu(grouped_linear(rows, self.w_gate_up, counts))
        y = grouped_linear(h, self.w_down, counts) * weights.flatten()[order, None].to(x.dtype)
        # back to (token, slot) order, then each token's k rows summed: index_add_ would add
        # them with atomics on a GPU, in an order (and so, in bf16, a result) that varies
        out = y.new_empty(t * k, y.shape[1]).index_copy_(0, order, y).view(t, k, y.shape[1]).sum(1)
        if self.shared_experts is not None and not self.shared_fused:
            out = out + self.shared_experts(x)
        return out

    def _stacked_bytes(self) -> int:
        return (self.w_gate_up.numel() + self.w_down.numel()) * self.w_gate_up.element_size()

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (0 where not routed)."""
        t, e = x.shape[0], self.w_gate_up.shape[0]
        dense = x.new_zeros(t, e).scatter_(1, ids, weights.to(x.dtype))      # [T, E (+ shared)]
        if self.shared_fused:
            dense[:, -1] = 1.0
        h = swiglu(F.linear(x, self.w_gate_up.view(-1, x.shape[1])).view(t, e, -1)) * dense[..., None]
        out = torch.bmm(h.transpose(0, 1), self.w_down.transpose(1, 2)).sum(0)     # [E, T, H] summed
        if self.shared_experts is not None and not self.shared_fused:
            out = out + self.shared_experts(x)
        return out

    def _loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Unfused: one expert at a time over the tokens routed to it (transformers' way)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _capturing(x: torch.Tensor) -> bool:
    """Whether x's device is recording a CUDA graph (kvtier.engine.graphs)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _graph_grouped_mm(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can run inside a CUDA graph for x: only its fast path (bf16 on
    compute capability 9.x or 10.x) reads nothing back to the host; its fallback copies the
    offsets to the CPU (torch's GroupedBlas.cpp / GroupedMMUtils.h)."""
    return _GROUPED_MM and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [N, in] sorted by expert, counts [E] rows per expert, weight [E, out, in] -> [N, out].

    torch._grouped_mm (one kernel for all experts; private API, on CPU in torch >= 2.9) where
    it runs, else one matmul per expert that has rows."""
    global _GROUPED_MM
    if _GROUPED_MM:
        try:
            return torch._grouped_mm(rows, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        except (RuntimeError, NotImplementedError):          # dtype or device it lacks: loop from now on
            if _capturing(rows):                             # a failed capture, not a missing kernel
                raise
            _GROUPED_MM = False
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    at = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[at:at + n] = rows[at:at + n] @ weight[e].T
            at += n
    return out
