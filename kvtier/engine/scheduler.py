"""Step 1 of the engine loop: which requests run this step, and how many tokens each.

Continuous batching with chunked prefill under a token budget. Running requests go
first, in arrival order (a decode costs one token, an unfinished prefill the next chunk);
waiting requests are admitted while budget, sequence slots and pages last. Admission is
where the cache pays: the prompt is keyed, the longest cached prefix is looked up in
every tier and loaded (device-tier blocks in place, lower tiers copied layer by layer),
and only the rest is computed. When pages run out, the most recently admitted request is
preempted: its pages are released (its full blocks are cached already) and it is
admitted again later, finding its own blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kvtier.adapter import KVAdapter
from kvtier.engine.request import Request, Status
from kvtier.errors import ConfigError, TransferError
from kvtier.keys import BlockKeys


@dataclass
class Scheduled:
    """One request's share of a step: `num_new` tokens starting at req.computed."""

    req: Request
    num_new: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token (and its drafts), so it samples."""
        return self.req.computed + self.num_new == self.req.num_tokens + len(self.req.draft)


class Scheduler:
    """Step 1 of the engine loop: which requests run this step and how many tokens each
    (admitting waiting ones with their cached prefix, preempting when pages run out), and
    what each finished step caches and frees. Holds pages only through the adapter."""

    def __init__(self, adapter: KVAdapter, *, max_batched_tokens: int = 1024, max_seqs: int = 64,
                 pin_ttl: float = 600.0, on_release: Callable[[Request], None] | None = None) -> None:
        if max_batched_tokens < 1 or max_seqs < 1:
            raise ConfigError("max_batched_tokens and max_seqs must be >= 1")
        self.adapter = adapter
        self.block_tokens = adapter.block_tokens
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.pin_ttl = pin_ttl              # the store config's pin_ttl (LLM passes it)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._blocked = False     # the head of the queue found no pages; retry when some are freed
        self.on_release = on_release   # called when a request's pages go back (a draft model frees its own)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    # -- step 1: schedule ------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        """This step's work: running requests first (a decode token each, or their next
        prefill chunk), then waiting ones admitted while the token budget and pages last."""
        budget = self.max_batched_tokens
        out: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget:
            req = self.running[i]
            n = self._decode_with_draft(req, budget) if req.draft else min(req.num_tokens - req.computed, budget)
            while not self.grow(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue                  # it was the victim: running[i] is the next one now
            out.append(Scheduled(req, n))
            budget -= n
            i += 1
        while self.waiting and budget and len(self.running) < self.max_seqs and not self._blocked:
            req = self.waiting[0]
            if not req.pages:
                self._admit(req)
            n = min(req.num_tokens - req.computed, budget)
            if not self.grow(req, n):
                self._drop_pages(req)
                if not self.running:
                    self.waiting.popleft()
                    req.status, req.finish_reason = Status.FINISHED, "error"
                    raise ConfigError(f"request {req.id!r} needs more KV pages than the device tier can free "
                                      "(the rest is pinned or held): give the engine a larger KV cache (StoreConfig(device_capacity=...))")
                # Speed: admitting it again costs a lookup and a load; wait until a running
                # request finishes or is preempted and pages come back.
                self._blocked = True
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n))
            budget -= n
        return out

    def _decode_with_draft(self, req: Request, budget: int) -> int:
        """Tokens for a decode step that verifies req.draft: the last token + as many drafts as the
        budget and the free pages allow (drafts are dropped, never other requests preempted, for them)."""
        if req.num_tokens - req.computed != 1:          # not decoding (a prefill chunk): no drafts
            req.draft, req.draft_probs = [], None
            return min(req.num_tokens - req.computed, budget)
        del req.draft[budget - 1:]
        if req.draft and not self.grow(req, 1 + len(req.draft)):
            req.draft, req.draft_probs = [], None
        return 1 + len(req.draft)

    def _admit(self, req: Request) -> None:
        """Key the request's tokens, look up the longest cached prefix and start loading it."""
        a = self.adapter
        match = a.lookup(req.tokens[:req.num_tokens - 1])   # the last token is always computed: it gives logits
        if req.session is not None and match.keys:
            a.pin(req.session, match.keys, self.pin_ttl)
        load = a.load(match)
        req.keys = match.keys                 # keyed once; save() extends the chain as blocks fill
        req.pages = list(load.pages)
        req.computed = load.blocks * self.block_tokens
        req.saved = load.cached               # copied-in blocks are cached with the step's own
        req.load = load if load.pending else None
        if req.preemptions == 0:
            req.cached_tokens = req.computed
            req.cached_by_tier = dict(load.from_tiers)

    def grow(self, req: Request, n: int) -> bool:
        """Give `req` pages for `n` more tokens; False if the device tier has none to spare."""
        return grow_pages(req, n, self.block_tokens, self.adapter.allocate)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._drop_pages(req)
        self._blocked = False
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # -- pages ---------------------------------------------------------------------------
    def save(self, req: Request) -> None:
        """Cache the request's newly completed full blocks (no copy): the pages become blocks."""
        save_blocks(self.adapter, req)

    def finish(self, req: Request, reason: str) -> None:
        """A request is done: pin its session's blocks, then give its pages back."""
        req.status, req.finish_reason = Status.FINISHED, reason
        self.running.remove(req)
        if req.session is not None and req.keys:
            self.adapter.pin(req.session, req.keys, self.pin_ttl)
        self._drop_pages(req)
        self._blocked = False

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is (a failed generate() must not leave work queued)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            self._drop_pages(req)
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or "abort"
        self._blocked = False

    def _drop_pages(self, req: Request) -> None:
        """Give the request's pages back (its full blocks are cached already and stay so)."""
        if req.load is not None:          # copies into its pages must finish before reuse
            try:
                req.load.wait()
            except TransferError:         # the load failed: its copies have stopped
                pass
            req.load = None
        self.adapter.free(req.pages)
        req.pages, req.computed, req.saved, req.keys, req.draft, req.draft_probs = [], 0, 0, None, [], None
        if self.on_release is not None:
            self.on_release(req)

    def trim(self, req: Request) -> None:
        """Give back pages allocated past what the next step needs (for rejected drafts' KV):
        they were never cached, as save() publishes only blocks of accepted tokens."""
        keep = max(-(-req.num_tokens // self.block_tokens), req.saved)
        if len(req.pages) > keep:
            extra, req.pages = req.pages[keep:], req.pages[:keep]
            self.adapter.free(extra)


class PagedSequence(Protocol):
    """What save_blocks needs of a sequence: a Request, or a draft model's state for one."""

    computed: int
    saved: int
    keys: BlockKeys | None
    pages: list[int]

    def token_range(self, start: int, end: int) -> list[int]: ...


def grow_pages(seq: Any, n: int, block_tokens: int, allocate: Callable[[int], list | None]) -> bool:
    """Give `seq` (anything with `computed` tokens and a list of `pages`: a request, a draft
    model's sequence) pages for `n` more tokens from `allocate`; False if it has none to spare."""
    need = -(-(seq.computed + n) // block_tokens) - len(seq.pages)
    if need <= 0:
        return True
    got = allocate(need)
    if got is None:
        return False
    seq.pages += got
    return True


def save_blocks(adapter: KVAdapter, seq: PagedSequence) -> None:
    """Cache a sequence's newly completed full blocks of computed tokens (no copy): its pages
    become blocks, keyed by continuing its chain. Tokens past `computed` (a draft's) never are."""
    bt = adapter.block_tokens
    full = seq.computed // bt
    if full <= seq.saved:
        return
    keys = seq.keys
    assert keys is not None               # set at admission
    if len(keys) < full:                  # key only the new blocks, continuing the chain
        more = adapter.keys(seq.token_range(len(keys) * bt, full * bt), parent=keys)
        seq.keys = keys = keys + more     # still one chain, and still this store's keys
    adapter.cache(keys[seq.saved:full], seq.pages[seq.saved:full])
    seq.saved = full
