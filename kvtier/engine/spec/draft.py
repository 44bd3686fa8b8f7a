"""Draft-model proposer: a smaller model with the target's tokenizer decodes k tokens ahead.

The draft keeps its own paged KV in a kvtier store of its own (a device tier only: draft KV
is cheap to recompute), with one `DraftSeq` per request: its pages, how many of the
request's tokens have draft KV (`computed`), and the drafts it fed past them (`fed`).

Each step, for every decoding request:

1. catch up: tokens the draft has not seen (the prompt at first, then the target's accepted
   tokens and its own last token) run as one chunk, all requests batched, under the same
   token budget as the target's steps (a long prompt is chunked over several steps; the
   request decodes without drafts until its draft has caught up). The last row's logits
   give d1.
2. decode: k - 1 batched single-token steps give d2..dk.

Rollback needs no work: the next catch-up compares `fed` with the request's real tokens;
the matching ones (the accepted drafts) count as computed, the rest are overwritten. Only
full blocks of real tokens are cached (`save_blocks`), so the draft's own prefix cache
never holds a rejected token's KV, and a request that comes back (preempted, or a prompt
sharing a prefix) finds its blocks there. Sampled requests draw each draft from the
draft's own distribution q (temperature and top-p as the request's), kept in
`Request.draft_probs` for the rejection rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from kvtier.adapter import KVAdapter
from kvtier.config import StoreConfig
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner, build_batch
from kvtier.engine.scheduler import grow_pages, save_blocks
from kvtier.engine.spec.verify import target_probs
from kvtier.errors import ConfigError
from kvtier.keys import BlockKeys

if TYPE_CHECKING:
    from kvtier.engine.llm import LLM


@dataclass
class DraftSeq:
    """The draft's view of one request: its pages in the draft's store and how far its KV is good."""

    req: Request
    pages: list[int] = field(default_factory=list)
    computed: int = 0                      # leading tokens of req.tokens with draft KV in `pages`
    saved: int = 0                         # leading full blocks cached in the draft's store
    keys: BlockKeys | None = None
    fed: list[int] = field(default_factory=list)   # drafts whose KV follows `computed` (maybe rejected)

    def token_range(self, start: int, end: int) -> list[int]:
        return self.req.token_range(start, end)


class DraftModelProposer:
    """Proposes with a draft model (a preset or checkpoint) over its own paged KV."""

    def __init__(self, model: str, target: LLM, seed: int = 0) -> None:
        from kvtier.engine.model import load_model

        self.model, self.info = load_model(model, device=str(target.model.device), seed=seed)
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ConfigError(f"the draft model {model!r} has a vocabulary of {self.model.config.vocab_size} "
                              f"tokens, the target {target.config.vocab_size}: a draft needs the target's tokenizer")
        bt = target.adapter.block_tokens
        layout = self.model.kv_layout(bt)
        # As many pages as the target's device tier: every running request can hold its draft KV.
        pages = target.adapter.device_tier.capacity_blocks
        store = StoreConfig(block_tokens=bt, device_capacity=pages * layout.block_bytes,
                            host_capacity=None).build(layout, self.info.namespace(), device=self.model.device)
        self.adapter = KVAdapter(store)
        try:
            self.runner = ModelRunner(self.model, self.adapter.pool())
        except BaseException:        # the target's LLM() fails with this: its draft pages must go too
            self.adapter.close()
            store.close()
            raise
        self.budget = target.scheduler.max_batched_tokens
        self.seqs: dict[str, DraftSeq] = {}

    # -- the engine's calls ------------------------------------------------------------
    def propose_requests(self, reqs: Sequence[Request], ks: Sequence[int]) -> None:
        """Set r.draft (and r.draft_probs for sampled requests) for each request, up to k tokens."""
        ready, budget = [], self.budget
        for r, k in zip(reqs, ks):
            r.draft, r.draft_probs = [], None
            if k < 1 or budget < 1:
                continue
            s = self._seq(r)
            n = min(r.num_tokens - s.computed, budget)
            if not self._grow(s, n + k - 1):
                continue                   # no draft pages to spare now: this step goes without drafts
            budget -= n
            ready.append((s, n, k))
        if not ready:
            return
        # 1. catch up on every token the draft has not seen; the last row gives d1.
        batch = build_batch([(s.token_range(s.computed, s.computed + n), s.computed, s.pages,
                              s.computed + n == s.req.num_tokens) for s, n, _ in ready], self.runner.device)
        logits = self.runner.run(batch)
        for s, n, _ in ready:
            s.computed += n
            save_blocks(self.adapter, s)
        live = [(s, k) for s, _, k in ready if s.computed == s.req.num_tokens]
        probs: dict[str, list[torch.Tensor]] = {s.req.id: [] for s, _ in live}
        pick_drafts([s.req for s, _ in live], logits, probs)
        # 2. decode d2..dk, one batched step per position.
        for j in range(1, max((k for _, k in live), default=0)):
            step = [s for s, k in live if k > j]
            batch = build_batch([([s.req.draft[-1]], s.req.num_tokens + j - 1, s.pages, True) for s in step],
                                self.runner.device)
            pick_drafts([s.req for s in step], self.runner.run(batch), probs)
        for s, _ in live:
            s.fed = s.req.draft[:-1]       # the last draft was sampled but never fed
            if probs[s.req.id]:
                s.req.draft_probs = torch.stack(probs[s.req.id])

    def release(self, req: Request) -> None:
        """The request's target pages went back (finished, aborted, preempted): so do its draft pages."""
        s = self.seqs.pop(req.id, None)
        if s is not None:
            self.adapter.free(s.pages)

    def close(self) -> None:
        self.adapter.close()
        self.adapter.store.close()

    # -- helpers -----------------------------------------------------------------------
    def _seq(self, r: Request) -> DraftSeq:
        """The request's draft state, rolled forward over the drafts the target accepted."""
        s = self.seqs.get(r.id)
        if s is None:
            s = self.seqs[r.id] = DraftSeq(r)
            match = self.adapter.lookup(r.token_range(0, r.num_tokens - 1))   # the draft's own prefix cache
            load = self.adapter.load(match)
            load.wait()                    # no lower tiers: nothing is copied
            s.pages, s.keys, s.saved = list(load.pages), match.keys, load.cached
            s.computed = load.blocks * self.adapter.block_tokens
            return s
        real = r.token_range(s.computed, min(s.computed + len(s.fed), r.num_tokens))
        # The request's last token is never counted as computed: it is what the next proposal
        # feeds. (The target can accept every token fed so far when the scheduler cut the
        # drafts it sent for verification, and a proposal of 0 tokens is no proposal.)
        m, most = 0, min(len(real), r.num_tokens - 1 - s.computed)
        while m < most and real[m] == s.fed[m]:
            m += 1
        s.computed, s.fed = s.computed + m, []
        save_blocks(self.adapter, s)
        return s

    def _grow(self, s: DraftSeq, n: int) -> bool:
        return grow_pages(s, n, self.adapter.block_tokens, self.adapter.allocate)


def pick_drafts(reqs: Sequence[Request], logits: torch.Tensor, probs: dict[str, list[torch.Tensor]]) -> None:
    """Append each request's next draft from its logits row (a draft model's or the MTP layer's):
    the argmax for greedy requests, else a draw from q (the request's temperature and top-p),
    whose row is kept in probs[r.id] for the rejection rule."""
    best = torch.argmax(logits, dim=-1).tolist()      # speed: one argmax for the greedy rows
    for i, r in enumerate(reqs):
        if r.params.greedy:
            r.draft.append(best[i])
            continue
        q = target_probs(logits[i:i + 1], r.params)[0]
        r.draft.append(int(torch.multinomial(q, 1, generator=r.generator)[0]))
        probs[r.id].append(q)
