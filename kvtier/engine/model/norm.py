"""RMSNorm as DeepSeek-V3 computes it: normalise in fp32, cast back, then scale by the weight.

Its eps matters for the cache: the cached latent is kv_a_layernorm's output, and that
norm (like q_a_layernorm) uses eps 1e-6 in DeepSeek's and transformers' code whatever
rms_norm_eps says (rms_norm_eps applies to the layer norms and the final norm only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The eps of the MLA-internal norms (q_a_layernorm, kv_a_layernorm): hard-coded upstream.
MLA_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Speed: torch's fused rms_norm (one kernel instead of pow, mean, add, rsqrt, mul);
        # the same formula in fp32, then cast back and scale as upstream does.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:   # the same ops, one call
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)
