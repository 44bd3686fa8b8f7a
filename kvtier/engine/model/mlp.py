"""The SwiGLU feed-forward block: down(silu(gate(x)) * up(x)).

The same module is the dense FFN of the first layers, each routed expert, and the
shared expert(s) of the MoE layers; only the widths differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_buffer("gate_up", None, persistent=False)    # set by fuse()

    def fuse(self) -> None:
        """gate_proj and up_proj as one [2 * inter, hidden] weight (the two become views of it).
        Speed: one matmul instead of two; costs nothing (no copy kept, hub names unchanged)."""
        self.gate_up = fuse_weights(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(F.linear(x, self.gate_up)))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [..., 2 * inter] = [gate, up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fuse_weights(*linears: nn.Linear) -> torch.Tensor:
    """One weight [sum of out_features, in] for linears that read the same input; each
    linear's weight becomes a view of it (so memory is not doubled and names stay).
    Speed: one matmul instead of several small ones (per-op overhead dominates decode)."""
    fused = torch.cat([m.weight.detach() for m in linears])
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[at:at + n], requires_grad=False)
        at += n
    return fused
