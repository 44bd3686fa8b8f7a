"""Rotary position embedding with DeepSeek's YaRN scaling, computed as transformers does.

YaRN (used by DeepSeek-V3 and Kimi K2) changes three numbers:
- the inverse frequencies: high-frequency dims keep their value (extrapolate), low ones are
  divided by `factor` (interpolate), with a linear ramp between `beta_fast`/`beta_slow`;
- `attention_factor`, multiplied into cos and sin: mscale(factor, mscale) /
  mscale(factor, mscale_all_dim) (1.0 for every published config, where both are 1.0);
- the softmax scale: qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2.

Element order: DeepSeek checkpoints (rope_interleave=true) rotate pairs (x0,x1),(x2,x3),...;
rope_interleave=false checkpoints rotate halves (x_i, x_{i+d/2}). We rotate in the
checkpoint's own order and never permute, so the rope key we cache is in that order
(transformers de-interleaves instead; q and k get the same order, so scores are equal).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kvtier.engine.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim/2] fp32, attention_factor applied to cos/sin)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    y = config.rope_scaling
    if y is None:
        return 1.0 / pos_freqs, 1.0
    factor = y["factor"]
    mscale, mscale_all_dim = y.get("mscale"), y.get("mscale_all_dim")
    attention_factor = y.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1
    orig = y["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                    # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp                               # 1: keep the original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def softmax_scale(config: ModelConfig) -> float:
    """The attention scale: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = config.qk_head_dim ** -0.5
    y = config.rope_scaling
    if y is not None and y.get("mscale_all_dim"):
        m = yarn_mscale(y["factor"], y["mscale_all_dim"])
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """The rotation tables of given positions, once per step for every layer: (cos, sin), each
    [T, rope_dim] fp32 in the checkpoint's element order, sin signed for apply_rope."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = config.rope_interleave

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor    # [T, d/2]
        # Speed: widened and signed here, once per step, so that apply_rope is two multiplies
        # and an add per layer (it was ~14 ops per layer: slices, four multiplies, stack).
        if self.interleaved:                     # pairs (x0, x1): x0' = x0 c - x1 s, x1' = x1 c + x0 s
            return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)   # halves (x_i, x_i+d/2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., d] by per-token angles (RotaryEmbedding's tables [T, d]), keeping x's
    element order: x * cos + partner(x) * sin, the partner of each element being the other
    one of its pair (interleaved) or of its half."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)
    if interleaved:
        partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        partner = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos, partner, sin)
