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
The output is sum(weight_e * expert_e(x)) + shared_experts(x). The experts run in a
plain loop, each over the tokens routed to it: readable, and what transformers does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.config import ModelConfig
from kvtier.engine.model.mlp import MLP


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
        group_scores = biased.view(t, self.n_group, e // self.n_group).topk(2, dim=-1).values.sum(-1)
        kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept_groups, 1.0).bool()
        expert_mask = group_mask.repeat_interleave(e // self.n_group, dim=1)
        ids = biased.masked_fill(~expert_mask, float("-inf")).topk(self.top_k, dim=-1, sorted=False).indices
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            y = self.experts[e](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
