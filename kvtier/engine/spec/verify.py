"""Verify k draft tokens against the target's logits at k + 1 positions, in one go.

Row j of the logits is the target's prediction after the last token and drafts d1..dj.
Greedy: accept d(j+1) while it is row j's argmax, then add the target's own token (the
argmax of the first mismatching row, or of row k when all were accepted). Sampling: the
standard speculative-sampling rule: accept d with probability min(1, p_j(d) / q_j(d)), else
draw from max(0, p_j - q_j) renormalised; all accepted, draw a bonus token from p_k. q is a
draft model's distribution, or a point mass at d (an n-gram proposer: accept with p_j(d),
else draw from p_j with d removed). Either way the emitted tokens follow the target's distribution.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvtier.engine.sampling import SamplingParams, cut


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sample() draws from, per row: softmax(logits / T), cut by min-p, top-k
    and top-p (sampling.cut), renormalised."""
    probs = cut(torch.softmax(logits.float() / params.temperature, dim=-1), [params] * logits.shape[0])
    return probs / probs.sum(dim=-1, keepdim=True)


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) for a greedy request; logits [len(draft) + 1, V]."""
    best = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for j, d in enumerate(draft):
        if best[j] != d:
            return out + [best[j]], j
        out.append(d)
    return out + [best[len(draft)]], len(draft)


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) by speculative sampling; probs [len(draft) + 1, V] is the
    target's p per row, draft_probs [len(draft), V] the draft's q (None: a point mass at each
    draft token, what an n-gram proposer gives). Accept d with probability min(1, p(d) / q(d));
    on the first rejection draw from max(0, p - q) renormalised; all accepted, draw a bonus
    token from the last row of p."""
    out: list[int] = []
    k = len(draft)
    if k:
        dev = probs.device
        u = torch.rand(k, generator=generator, device=dev).tolist()
        rows, ids = torch.arange(k, device=dev), torch.tensor(list(draft), device=dev)
        p_draft = probs[rows, ids].tolist()
        q_draft = [1.0] * k if draft_probs is None else draft_probs[rows, ids].tolist()
    for j, d in enumerate(draft):
        if u[j] * q_draft[j] < p_draft[j]:   # u < p/q without dividing (q(d) > 0: d was drawn from q)
            out.append(d)
            continue
        if draft_probs is None:
            rest = probs[j].clone()
            rest[d] = 0.0                    # max(0, p - q) with q the point mass at d
        else:
            rest = torch.clamp(probs[j] - draft_probs[j], min=0.0)
            if float(rest.sum()) <= 0.0:     # p == q up to rounding: a rejection had probability ~0
                rest = probs[j]
        return out + [int(torch.multinomial(rest, 1, generator=generator)[0])], j
    return out + [int(torch.multinomial(probs[k], 1, generator=generator)[0])], k


def verify(logits: torch.Tensor, draft: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> tuple[list[int], int]:
    """The tokens a request emits this step and how many drafts were accepted (draft_probs: the
    draft model's q for each draft token's row; None for a point-mass proposer)."""
    if params.greedy:
        return accept_greedy(logits, draft)
    return accept_sampled(target_probs(logits, params), draft, generator, draft_probs)
