"""One generation request and everything the engine tracks for it.

A request's tokens are its prompt followed by what it generated so far. `computed` of
them have KV in the request's pages; every step computes the next ones (a prefill chunk,
or the single newest token when decoding) and, when it reaches the last token, samples
one more. `pages[i]` is the device-tier page of block i; the store's PagePool knows
whether it is a cached block or the request's own (free() handles both at the end).
With speculative decoding, `draft` holds tokens guessed past the last one: a decode step
computes the last token and the drafts together (token_range reaches into them), and the
postprocess keeps only what the target accepted.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kvtier.adapter import PageLoad
from kvtier.engine.sampling import SamplingParams
from kvtier.keys import BlockKeys


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    session: str | None = None
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None          # "length", "stop"
    computed: int = 0                         # leading tokens with KV in `pages`
    pages: list[int] = field(default_factory=list)
    saved: int = 0                            # leading full blocks known cached (hit or cached)
    keys: BlockKeys | None = None             # keys of the full blocks of `tokens`, as far as computed
    load: PageLoad | None = None            # a prefix load whose copies the next step waits for
    generator: torch.Generator | None = None
    draft: list[int] = field(default_factory=list)   # speculative tokens after the last one (not yet accepted)
    draft_probs: torch.Tensor | None = None   # [len(draft), V]: a draft model's q per draft token (sampled requests)
    # What the cache did for it (first admission only) and when things happened.
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building prompt + output (a long prompt is sliced every step).
        Past num_tokens it reads the draft: the speculative tokens a verify step computes."""
        if end > self.num_tokens:
            k = self.num_tokens
            return self.token_range(start, k) + self.draft[max(start - k, 0):end - k] if start < k \
                else self.draft[start - k:end - k]
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:] + self.output[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival
