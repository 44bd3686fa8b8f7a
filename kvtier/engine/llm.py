"""The reference engine's front door: `LLM(preset_or_path).generate(prompts, SamplingParams(...))`.

Each step is the four-step loop:

    scheduled = scheduler.schedule()        # 1. who runs, how many tokens; prefix lookups and loads
    batch = runner.prepare(scheduled)       # 2. flat tokens, positions, page lists
    logits = runner.run(batch)              # 3. the model, over kvtier's device tier as KV pages
    self._postprocess(scheduled, logits)    # 4. sample, save full blocks, finish

With `speculative=SpeculativeConfig(...)` a proposer first guesses up to k tokens for each
decoding request; the decode step computes [last token, d1..dk], samples from every one
of those positions (kvtier.engine.spec.verify) and keeps what the target accepts. Only
accepted tokens count as computed, so only blocks made entirely of accepted tokens are
ever published; pages taken for rejected drafts are given back.

The KV pages are the store's device tier, so a prefix cached there costs no copy, and a
finished request's blocks stay cached (evicted to host memory and disk under pressure)
for the next request that shares the prefix.
"""
from __future__ import annotations

import functools
import itertools
import numbers
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from kvtier.adapter import KVAdapter
from kvtier.config import StoreConfig
from kvtier.engine.model import load_model
from kvtier.engine.batch import StepBatch
from kvtier.engine.graphs import DecodeGraphs
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams, _is_int, make_generator, sample
from kvtier.engine.scheduler import Scheduled, Scheduler
from kvtier.engine.spec import SpeculativeConfig, SpecStats, make_proposer
from kvtier.engine.spec.verify import verify
from kvtier.engine.tokenizer import load_tokenizer
from kvtier.errors import ClosedError, ConfigError
from kvtier.store import Store

if TYPE_CHECKING:
    from kvtier.net.remote import Remote


@dataclass
class RequestOutput:
    """A finished request: its tokens and text, and what the cache did for it."""

    id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int                          # prompt tokens loaded from the store, not computed
    cached_by_tier: dict[str, int] = field(default_factory=dict)   # cached blocks per source tier
    ttft: float | None = None                   # seconds from arrival to the first token
    preemptions: int = 0


F = TypeVar("F", bound=Callable[..., Any])


def _one_at_a_time(method: F) -> F:
    """The engine's calls from several threads run one after another (its scheduler, pages
    and requests are one loop's state: two threads' steps interleaved failed with unrelated
    errors and lost pages for good). Reentrant: generate() calls add_request() and step()."""
    @functools.wraps(method)
    def locked(self: LLM, *args: Any, **kw: Any) -> Any:
        with self._calls:
            return method(self, *args, **kw)
    return locked  # type: ignore[return-value]


class LLM:
    """A DeepSeek-V3 / Kimi K2 engine whose KV cache is a kvtier store.

    `model` is a preset name (`kimi-tiny`: random weights, byte-level tokenizer, runs on a
    CPU) or a Hugging Face checkpoint directory (config.json + safetensors). The store is
    built from `cache` (a kvtier.StoreConfig: device tier size, host tier, disk tier, policy, pin TTL), or
    passed in as `store` (its first tier must be a DeviceTier with this model's layout).
    `remote` (a kvtier.Remote) lets the store it builds fetch blocks other nodes hold.
    `speculative` (a SpeculativeConfig) turns on speculative decoding (n-gram prompt lookup, a
    draft model, or the checkpoint's MTP layer). `cuda_graphs` replays decode steps as CUDA
    graphs (kvtier.engine.graphs; None: on when the model is on a GPU, except with MTP
    speculation, whose steps need every token's hidden state).
    """

    _calls: threading.RLock

    def __init__(self, model: str = "kimi-tiny", *, seed: int = 0, dtype: str | torch.dtype | None = None,
                 device: str | None = None, cache: StoreConfig | None = None, store: Store | None = None,
                 max_batched_tokens: int = 1024, max_seqs: int = 64, remote: Remote | None = None,
                 speculative: SpeculativeConfig | None = None, cuda_graphs: bool | None = None) -> None:
        if not isinstance(model, (str, os.PathLike)) or not str(model):
            raise ConfigError(f"model must be a preset name (e.g. 'kimi-tiny') or a checkpoint folder, got {model!r}")
        if cache is not None and not isinstance(cache, StoreConfig):
            raise ConfigError(f"cache must be a kvtier.StoreConfig(...), not {type(cache).__name__}")
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ConfigError("speculative must be a kvtier.engine.spec.SpeculativeConfig(...), "
                              f"not {type(speculative).__name__}")
        for name, value, lo, hi in (("seed", seed, 0, 2**64 - 1), ("max_batched_tokens", max_batched_tokens, 1, None),
                                    ("max_seqs", max_seqs, 1, None)):
            if not _is_int(value) or value < lo or (hi is not None and value > hi):
                raise ConfigError(f"{name} must be a whole number {'in ' + str(lo) + '..' + str(hi) if hi else '>= ' + str(lo)}"
                                  f", got {value!r}")
        self.speculative = speculative
        self.spec_stats = SpecStats()
        mtp = speculative is not None and speculative.method == "mtp"   # build the checkpoint's MTP layer too
        self.model, self.info = load_model(model, dtype=dtype, device=device, seed=seed, mtp=mtp)
        self.config = self.model.config
        on_gpu = self.model.device.type == "cuda"
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be True, False or None (on with a GPU), got {cuda_graphs!r}")
        if cuda_graphs and not on_gpu:
            raise ConfigError("cuda_graphs=True needs the model on a CUDA device (device='cuda')")
        if cuda_graphs and mtp:
            raise ConfigError("cuda_graphs=True does not go with MTP speculation (its steps read every token's "
                              "hidden state): leave cuda_graphs unset")
        cache = cache or StoreConfig()
        layout = self.model.kv_layout(cache.block_tokens)
        if store is not None and remote is not None:
            raise ConfigError("give remote= to the store you pass (StoreConfig.build(..., remote=...)), not to LLM")
        if store is not None and cache is not None:   # its tiers' settings would be ignored without a word
            default = StoreConfig()
            ignored = [f for f in StoreConfig.fields()
                       if f not in ("block_tokens", "pin_ttl") and getattr(cache, f) != getattr(default, f)]
            if ignored:
                raise ConfigError(f"cache= sets {', '.join(ignored)}, which store= decides: build the store you pass "
                                  "with them (with store=, cache= gives only block_tokens and pin_ttl)")
        self.store = store if store is not None else cache.build(layout, self.info.namespace(),
                                                                 device=self.model.device, remote=remote)
        self._own_store = store is None
        self._lent: list[int] = []                # pages the engine itself holds (the graphs' scratch page)
        adapter: KVAdapter | None = None
        try:          # whatever fails from here on (a bad store, tokenizer or draft) closes what was built
            if self.store.layout != layout:
                raise ConfigError(f"the store's layout ({self.store.layout.describe()}, variant "
                                  f"{self.store.layout.variant!r}) is not this model's ({layout.describe()}, variant "
                                  f"{layout.variant!r}): build it with model.kv_layout(block_tokens)")
            if self.store.namespace != self.info.namespace(self.store.namespace.salt, self.store.namespace.shard):
                raise ConfigError(f"the store's namespace {self.store.namespace} is not this model's "
                                  f"(model {self.info.name!r}, revision {self.info.revision!r}): its blocks came from "
                                  "other weights; build the store with info.namespace()")
            self.adapter = adapter = KVAdapter(self.store)
            if adapter.device_tier.device != self.model.device:   # the pages must be the device tier, by the model
                raise ConfigError(f"the store's device tier is on {adapter.device_tier.device} but the model is on "
                                  f"{self.model.device}: put both on one device")
            self.tokenizer = load_tokenizer(self.info.tokenizer_path, self.config.vocab_size)
            self.scheduler = Scheduler(adapter, max_batched_tokens=max_batched_tokens, max_seqs=max_seqs,
                                       pin_ttl=cache.pin_ttl)
            self.runner = ModelRunner(self.model, adapter.pool())
            if cuda_graphs or (cuda_graphs is None and on_gpu and not mtp):
                self._start_graphs(capture=True)
            self.proposer = make_proposer(speculative, self, seed) if speculative is not None else None
        except BaseException:
            if adapter is not None:
                _close(adapter, self.store if self._own_store else None, lent=self._lent)
            elif self._own_store:
                self.store.close()
            raise
        release = getattr(self.proposer, "release", None)
        self.scheduler.on_release = release       # a draft model frees its own pages with the request's
        # A store this engine built is closed (flushed down to disk) when the engine is
        # garbage collected without close(); at interpreter exit every open store closes itself.
        self._finalizer = weakref.finalize(self, _close, self.adapter, self.store if self._own_store else None,
                                           getattr(self.proposer, "close", None), self._lent)
        self._finalizer.atexit = False
        self._closed = False
        self._calls = threading.RLock()           # see _one_at_a_time
        # Host seconds spent in each step of the loop since the engine started (benchmarks take
        # differences): "schedule" holds admission (pages, evicting or demoting other blocks,
        # the prefix lookup, starting a load); on a GPU the model's time shows in "postprocess",
        # where sampling waits for the logits.
        self.phase_seconds: dict[str, float] = dict.fromkeys(("schedule", "prepare", "run", "postprocess"), 0.0)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.config.eos_token_id

    def _start_graphs(self, capture: bool) -> None:
        """Decode steps through kvtier.engine.graphs (capture=False: the same padded steps run
        eagerly, what tests on a CPU check); the graphs' scratch page is lent until close()."""
        page = self.adapter.allocate(1)
        if page is None:
            raise ConfigError("no free KV page for the CUDA graphs' scratch page: give the engine a larger KV cache "
                              "(StoreConfig(device_capacity=...), --kv-cache)")
        self._lent += page
        self.runner.graphs = DecodeGraphs(self.model, self.runner.kv_pool, page[0], self.scheduler.max_seqs,
                                         capture)

    # -- requests ----------------------------------------------------------------------
    @property
    def request_pages(self) -> int:
        """KV pages one request may use at most: the device tier's, less the CUDA graphs'
        scratch page."""
        return self.adapter.device_tier.capacity_blocks - len(self._lent)

    @property
    def pages_in_use(self) -> int:
        """KV pages held by requests (owned or referenced by a running request), not counting
        the engine's own (the CUDA graphs' scratch page): 0 on an idle engine."""
        pool = self.store.pages
        return len(pool.owned()) + len(pool.referenced()) - len(self._lent)

    @_one_at_a_time
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    session: str | None = None) -> str:
        """Queue one request (text, or token ids); returns its id."""
        if self._closed:
            raise ClosedError("this LLM is closed; create a new one")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a kvtier.engine.SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            bos = self.tokenizer.bos_token_id      # text starts with BOS, as the checkpoints were trained
            ids = ([bos] if bos is not None else []) + self.tokenizer.encode(prompt)
        else:
            ids = _token_ids(prompt)
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ConfigError(f"prompt token ids must be ints in [0, {vocab}) for this model")
        params.check_vocab(vocab)
        limit = self.config.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise ConfigError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                              f"model's {limit} positions")
        pages = -(-(len(ids) + params.max_tokens) // self.adapter.block_tokens)
        room = self.request_pages
        if pages > room:
            raise ConfigError(f"this request needs {pages} KV pages but the device tier has {room} for "
                              "requests: give the engine a larger KV cache (StoreConfig(device_capacity=...), --kv-cache)")
        if session is not None and (not isinstance(session, str) or not session):
            raise ConfigError("session must be a non-empty string (e.g. the x-session-affinity header)")
        req = Request(f"req-{next(self._ids)}", ids, params, session, generator=make_generator(params, self.model.device))
        self.scheduler.add(req)
        self._requests[req.id] = req
        return req.id

    @_one_at_a_time
    def abort(self, request_id: str) -> None:
        """Drop a queued or running request; its pages go back to the store."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.abort(req)

    def request(self, request_id: str) -> Request | None:
        """A queued or running request (its `output` so far, `status`), None once it finished
        or was aborted: what a server streams from between steps."""
        return self._requests.get(request_id)

    @_one_at_a_time
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 sessions: Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts (text or token-id lists) to completion; outputs in prompt order. Calls
        from other threads wait for it (one engine runs one loop)."""
        if self._requests:      # their outputs would come out of this call's steps and be lost
            raise ConfigError(f"generate() runs its own prompts only, and {len(self._requests)} request(s) queued "
                              "with add_request() are unfinished: step() them to the end first")
        prompts = _prompt_list(prompts)
        if isinstance(sessions, str):
            raise ConfigError("sessions is a list with one session id (or None) per prompt, e.g. [\"agent-1\"]")
        n = len(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params] * n
        slist = list(sessions) if sessions is not None else [None] * n
        if len(plist) != n or len(slist) != n:
            raise ConfigError(f"got {n} prompts, {len(plist)} sampling params and {len(slist)} sessions")
        order: dict[str, int] = {}
        out: list[RequestOutput | None] = [None] * n
        try:
            for i, (p, sp, s) in enumerate(zip(prompts, plist, slist)):
                order[self.add_request(p, sp, s)] = i
            while any(o is None for o in out):
                for done in self.step():
                    if done.id in order:
                        out[order[done.id]] = done
        except BaseException:
            for rid in order:                                     # nothing of this call stays queued
                self.abort(rid)
            raise
        return out                                                # type: ignore[return-value]

    # -- the loop ----------------------------------------------------------------------
    @_one_at_a_time
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        if self._closed:
            raise ClosedError("this LLM is closed; create a new one")
        if self.proposer is not None:
            self._propose()                                       # 0. drafts for decoding requests
        clock, t = self.phase_seconds, time.perf_counter()
        scheduled = self.scheduler.schedule()                     # 1. schedule
        t1 = time.perf_counter()
        clock["schedule"] += t1 - t
        if not scheduled:
            return []
        batch = self.runner.prepare(scheduled)                    # 2. prepare
        if any(s.req.draft for s in scheduled):                   # logits at every verified position
            batch.logits_index = _verify_rows(scheduled, batch)
        t2 = time.perf_counter()
        if getattr(self.proposer, "wants_hidden", False):        # 3. run (the MTP layer reads hidden states)
            logits, hidden = self.runner.run(batch, hidden=True)
        else:
            logits, hidden = self.runner.run(batch), None
        t3 = time.perf_counter()
        out = self._postprocess(scheduled, logits, batch, hidden)   # 4. postprocess
        clock["prepare"] += t2 - t1
        clock["run"] += t3 - t2
        clock["postprocess"] += time.perf_counter() - t3
        return out

    def _propose(self) -> None:
        """Ask the proposer for up to k tokens after each decoding request's last one (k: the
        request's SamplingParams.num_speculative_tokens, else the engine's, and never more than
        the engine's: what it was configured and sized for; not past max_tokens: the target
        adds one more of its own)."""
        assert self.proposer is not None and self.speculative is not None
        reqs, ks = [], []
        most = self.speculative.num_speculative_tokens
        for r in self.scheduler.running:
            k = r.params.num_speculative_tokens
            room = min(most if k is None else min(k, most), r.params.max_tokens - len(r.output) - 1)
            r.draft, r.draft_probs = [], None
            if room > 0 and r.num_tokens - r.computed == 1:
                reqs.append(r)
                ks.append(room)
        batched = getattr(self.proposer, "propose_requests", None)
        if batched is not None:                                   # a draft model: one batch for all
            batched(reqs, ks)
            return
        for r, k in zip(reqs, ks):
            r.draft = self.proposer.propose(r.tokens, k)

    def _postprocess(self, scheduled: Sequence[Scheduled], logits: torch.Tensor, batch: StepBatch | None = None,
                     hidden: torch.Tensor | None = None) -> list[RequestOutput]:
        """Step 4: sample (or verify a draft), append the tokens, cache the pages that became
        full (Scheduler.save) and finish requests that stop."""
        sampling = [s for s in scheduled if s.samples]
        emitted = self._sample(sampling, logits) if sampling else []
        now = time.perf_counter()
        finished: list[Request] = []
        toks = iter(emitted)
        samples = [s.samples for s in scheduled]                # before `computed` moves
        olds, drafted = [s.req.computed for s in scheduled], [bool(s.req.draft) for s in scheduled]
        for s, samples_now in zip(scheduled, samples):          # the pages now hold these tokens' KV
            r = s.req
            old = r.computed
            r.computed += s.num_new
            if samples_now:
                reason = None
                new = next(toks)
                for tok in new:                                  # accepted drafts, then the target's token
                    r.output.append(tok)
                    reason = self._stop_reason(r, tok)
                    if reason is not None:
                        break
                if r.first_token_at is None:
                    r.first_token_at = now
                if r.draft:                                      # KV is valid up to the last accepted draft
                    # (a stop inside the drafts: as plain decoding, the last token never counts as
                    # computed, so the MTP layer always has the token after each computed one)
                    r.computed = min(old + len(new), r.num_tokens - 1)
                    r.draft, r.draft_probs = [], None
                if reason is not None:
                    r.finish_reason = reason
                    finished.append(r)
            if r.load is not None:                               # copies from lower tiers are in:
                r.load.wait()                                    # save() caches those pages too
                r.load = None
        if hidden is not None:                                   # the MTP layer's KV of the accepted tokens,
            assert batch is not None                             # before their blocks are published
            self.proposer.after_step([(s.req, seq.start, old) for s, seq, old in zip(scheduled, batch.seqs, olds)],
                                     hidden)
        for s, was_drafted in zip(scheduled, drafted):
            r = s.req
            self.scheduler.save(r)                               # only blocks of accepted tokens
            if was_drafted and r.finish_reason is None:
                self.scheduler.trim(r)                           # pages of rejected drafts go back
        out = []
        for r in finished:
            self.scheduler.finish(r, r.finish_reason or "stop")
            self._requests.pop(r.id, None)
            out.append(self._output(r))
        return out

    def _sample(self, sampling: Sequence[Scheduled], logits: torch.Tensor) -> list[list[int]]:
        """Each sampling request's new tokens: one sampled token, or verified drafts + one."""
        if not any(s.req.draft for s in sampling):
            return [[t] for t in sample(logits, [s.req.params for s in sampling],
                                        [s.req.generator for s in sampling]).tolist()]
        out, row = [], 0
        for s in sampling:
            r, k = s.req, len(s.req.draft)
            rows = logits[row:row + k + 1]
            row += k + 1
            if k == 0:
                out.append(sample(rows, [r.params], [r.generator]).tolist())
                continue
            q = r.draft_probs[:k] if r.draft_probs is not None else None   # the scheduler may cut the draft
            toks, accepted = verify(rows, r.draft, r.params, r.generator, q)
            self.spec_stats.record(k, accepted)
            out.append(toks)
        return out

    def _stop_reason(self, r: Request, tok: int) -> str | None:
        p = r.params
        if tok in p.stop_set or (tok == self.eos and not p.ignore_eos):
            return "stop"
        if len(r.output) >= p.max_tokens:
            return "length"
        return None

    def _output(self, r: Request) -> RequestOutput:
        return RequestOutput(r.id, list(r.prompt), list(r.output), self.tokenizer.decode(r.output),
                             r.finish_reason or "", r.cached_tokens, r.cached_by_tier, r.ttft, r.preemptions)

    # -- lifetime --------------------------------------------------------------------------
    def stats(self) -> dict:
        """The store's counters and tiers, the scheduler's preemptions, and speculation's counters
        (drafts, draft_tokens, accepted_tokens, accepted_per_position, mean_acceptance_length)
        when it is on."""
        if self._closed:
            raise ClosedError("this LLM is closed; create a new one")
        out = {"store": self.store.stats(), "preemptions": self.scheduler.preemptions}
        if self.runner.graphs is not None:
            out["cuda_graphs"] = self.runner.graphs.info()
        if self.speculative is not None:
            out["spec"] = self.spec_stats.as_dict()
        return out

    @_one_at_a_time
    def close(self) -> None:
        """Finish, flush the cache's blocks down to its persistent tiers, release everything."""
        self._closed = True
        if self.runner.graphs is not None:
            self.runner.graphs.close()
        self._finalizer()

    def __enter__(self) -> LLM:
        if self._closed:
            raise ClosedError("this LLM is closed; create a new one")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _verify_rows(scheduled: Sequence[Scheduled], batch) -> torch.Tensor:
    """Logits rows of a batch where requests verify drafts: every sampling request's last
    1 + len(draft) tokens (the runner asks for the last one only)."""
    rows: list[int] = []
    for s, seq in zip(scheduled, batch.seqs):
        if s.samples:
            end = seq.start + seq.num_new
            rows += range(end - 1 - len(s.req.draft), end)
    return torch.tensor(rows, dtype=torch.int64, device=batch.logits_index.device)


def _prompt_list(prompts: object) -> list:
    """generate()'s prompts as a list: one prompt (text, token ids as a list, a 1-D array or
    tensor) becomes a list of one; a list, tuple or any other iterable of prompts is listed."""
    if isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise ConfigError("prompts must be text, a list of token ids, or a list of those, "
                          f"not {type(prompts).__name__}")
    if isinstance(prompts, str) or (getattr(prompts, "ndim", None) == 1 and hasattr(prompts, "dtype")):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and _token(prompts[0]):
        return [prompts]
    return list(prompts)                        # type: ignore[call-overload]


def _token(x: object) -> bool:
    """A token id: a Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)     # numpy's integers register


def _close(adapter: KVAdapter, store: Store | None, close_proposer: Callable[[], None] | None = None,
           lent: list[int] | None = None) -> None:
    if close_proposer is not None:
        close_proposer()
    if lent:                                   # a store passed in outlives the engine: its pages go back
        adapter.free(lent)
        lent.clear()
    adapter.close()
    if store is not None:
        store.close()


def _token_ids(prompt: object) -> list[int]:
    """Token ids from a list, a numpy array or a tensor of integers (not bools, not floats)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype == torch.bool or prompt.dim() != 1:
            raise ConfigError(f"a prompt tensor must be 1-D integer token ids, got {prompt.dtype} {list(prompt.shape)}")
        return prompt.tolist()
    if hasattr(prompt, "tolist") and hasattr(prompt, "dtype"):            # numpy
        if getattr(prompt.dtype, "kind", "") not in "iu" or getattr(prompt, "ndim", 1) != 1:
            raise ConfigError(f"a prompt array must be 1-D integer token ids, got {prompt.dtype}")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise ConfigError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}")
    ids = list(prompt)
    if set(map(type, ids)) <= {int}:         # Speed: the usual list of ints, checked in C (~0.8 ms
        return ids                           # a 4K-token prompt one by one in Python)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) and not (hasattr(t, "__index__") and not isinstance(t, float)):
            raise ConfigError(f"prompt token ids must be ints, got {t!r}")
    return [int(t) for t in ids]
