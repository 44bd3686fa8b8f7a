"""Verify k draft tokens against the target's logits at k + 1 positions, in one go.

Row j of the logits is the target's prediction after the last token and drafts d1..dj.
Greedy: accept d(j+1) while it is row j's argmax, then add the target's own token (the
argmax of the first mismatching row, or of row k when all were accepted). Sampling: the
standard rejection rule with a point-mass draft (what an n-gram proposer gives): accept d
with probability p_j(d), else draw from p_j with d removed and renormalised; all accepted,
draw a bonus token from p_k. Either way the emitted tokens follow the target's distribution.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvtier.engine.sampling import SamplingParams, _top_p_filter


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, per row: softmax(logits / T), nucleus-cut, renormalised."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        top = torch.full((probs.shape[0],), params.top_p, device=probs.device, dtype=torch.float32)
        probs = _top_p_filter(probs, top)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) for a greedy request; logits [len(draft) + 1, V]."""
    best = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for j, d in enumerate(draft):
        if best[j] != d:
            return out + [best[j]], j
        out.append(d)
    return out + [best[len(draft)]], len(draft)


def accept_point_mass(probs: torch.Tensor, draft: Sequence[int],
                      generator: torch.Generator | None) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) by rejection sampling; probs [len(draft) + 1, V] (rows sum to 1)."""
    out: list[int] = []
    k = len(draft)
    if k:
        u = torch.rand(k, generator=generator, device=probs.device).tolist()
        p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(list(draft), device=probs.device)].tolist()
    for j, d in enumerate(draft):
        if u[j] < p_draft[j]:
            out.append(d)
            continue
        rest = probs[j].clone()
        rest[d] = 0.0                        # max(0, p - q) with q the point mass at d
        return out + [int(torch.multinomial(rest, 1, generator=generator)[0])], j
    return out + [int(torch.multinomial(probs[k], 1, generator=generator)[0])], k


def verify(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """The tokens a request emits this step and how many drafts were accepted."""
    if params.greedy:
        return accept_greedy(logits, draft)
    return accept_point_mass(target_probs(logits, params), draft, generator)
