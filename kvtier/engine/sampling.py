"""Turn a step's logits into next tokens: greedy, or temperature sampling cut by min-p,
top-k and top-p (nucleus), in that order, as vLLM applies them.

Each request that samples owns a `torch.Generator` seeded from its `SamplingParams.seed`
(`make_generator`), and its row is drawn with that generator alone, so a seeded request
yields the same tokens whatever else is in the batch and in whatever row it sits
(without speculation: how many drafts a request gets depends on the step's budget, see
docs/engine.md). Greedy rows take the argmax (ties go to the lowest id) and use no randomness at all.
"""
from __future__ import annotations

import math
import inspect
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from kvtier.errors import ConfigError

__all__ = ["SamplingParams", "sample", "make_generator"]

_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes seeds in [0, 2**64)


SAMPLING_EPS = 1e-5   # a temperature below this samples greedily (as vLLM does)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# vLLM's SamplingParams fields this engine does not have, and what to do instead.
_NOT_HERE = {
    "n": "one sequence per request: generate the prompt n times (with different seeds)",
    "best_of": "one sequence per request",
    "stop": "stop strings are not supported: give stop_token_ids",
    "logprobs": "log-probabilities are not returned",
    "prompt_logprobs": "log-probabilities are not returned",
    "presence_penalty": "no penalties", "frequency_penalty": "no penalties", "repetition_penalty": "no penalties",
    "min_tokens": "give ignore_eos=True and max_tokens for a fixed length",
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16                   # tokens to generate at most
    temperature: float = 0.0               # 0 = greedy (argmax); > 0 divides the logits before softmax
    top_p: float = 1.0                     # nucleus: sample from the fewest top tokens holding >= top_p mass
    seed: int | None = None                # same seed -> same tokens; None -> fresh entropy
    stop_token_ids: tuple[int, ...] = ()   # generating one of these ends the request (it is kept)
    ignore_eos: bool = False               # keep going past EOS (benchmarks want fixed lengths)
    num_speculative_tokens: int | None = None   # per request: drafts per step (0 = off), at most the engine's; None = the engine's
    top_k: int = 0                         # sample from the k most likely tokens (ties at the k-th kept); 0 or -1: all
    min_p: float = 0.0                     # drop tokens less likely than min_p x the top token's; 0: none
    stop_set: frozenset[int] = field(init=False, repr=False, compare=False, default=frozenset())   # stop_token_ids

    def __new__(cls, *args: object, **kw: object) -> SamplingParams:
        # Before the dataclass's __init__, whose TypeError names no close match (or, for
        # vLLM's n and stop, nothing of what to do instead).
        from kvtier.config import check_names
        for name in kw:
            if name in _NOT_HERE:
                raise ConfigError(f"SamplingParams has no {name!r}: {_NOT_HERE[name]}")
        check_names(kw, [f.name for f in fields(cls) if f.init], "SamplingParams")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ConfigError(f"top_k must be an int >= 1, or 0 or -1 for all tokens, got {self.top_k!r}")
        if (isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float))
                or not 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1] (0 = no cut), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ConfigError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise ConfigError(f"stop_token_ids must be a list of token ids, e.g. [2], got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        for t in stops:             # checked before they are made unique: True == 1 and 1.0 == 1
            if not (_is_int(t) and t >= 0):
                raise ConfigError(f"stop_token_ids must be token ids (ints >= 0), got {t!r} among them")
        stops = tuple(dict.fromkeys(stops))                 # accept a list, store a tuple, each id once
        object.__setattr__(self, "stop_token_ids", stops)
        # Speed: every generated token is checked against the stops; a set, not a scan of the tuple
        object.__setattr__(self, "stop_set", frozenset(stops))
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or k < 0):
            raise ConfigError(f"num_speculative_tokens must be None (the engine's) or an int >= 0 (0 = off), got {k!r}")

    def check_vocab(self, vocab: int) -> None:
        """Refuse stop ids a model with `vocab` tokens could never generate (the engine checks
        at submission; a server before it, so the refusal is not an engine failure)."""
        past = next((t for t in self.stop_token_ids if t >= vocab), None)
        if past is not None:
            raise ConfigError(f"stop_token_ids must be token ids in [0, {vocab}) for this model (one past it could "
                              f"never be generated), got {past}")

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy too: dividing float32 logits by them
        overflows (1e-45 gave inf/nan probabilities), and they are argmax in all but name."""
        return self.temperature < SAMPLING_EPS


# help() and IDEs show the fields, not __new__'s (*args, **kw)
SamplingParams.__signature__ = inspect.signature(SamplingParams.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(SamplingParams.__init__).parameters.values())[1:])


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The request's own RNG: None for greedy, else seeded from params.seed (or fresh entropy).

    Pass the device the logits live on: torch.multinomial wants a generator on that device.
    """
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()                 # non-deterministic seed
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Next token of each row: logits [B, V] float -> int64 [B] on the logits' device.

    Row i follows params[i] and draws with generators[i] (None: torch's default RNG, which
    is not reproducible per request; give sampling rows a `make_generator` generator).
    """
    if logits.dim() != 2:
        raise ConfigError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    b = logits.shape[0]
    if len(params) != b or len(generators) != b:
        raise ConfigError(f"one SamplingParams and one generator per logits row: {b} rows, "
                          f"{len(params)} params, {len(generators)} generators")
    out = torch.argmax(logits, dim=-1)       # greedy rows: argmax takes the first (lowest id) maximum
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    temp = torch.tensor([params[i].temperature for i in rows], device=logits.device, dtype=torch.float32)
    probs = cut(torch.softmax(logits[idx].float() / temp[:, None], dim=-1), [params[i] for i in rows])
    for j, i in enumerate(rows):
        out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out


def cut(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Row i of `probs` cut by params[i]'s min-p, then top-k, then top-p (what sample() and
    speculative verification draw from), not renormalised."""
    device = probs.device
    min_p = [p.min_p for p in params]
    if any(p > 0 for p in min_p):
        probs = _min_p_filter(probs, torch.tensor(min_p, device=device, dtype=torch.float32))
    vocab = probs.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]   # k >= the vocabulary keeps all
    if any(top_k):
        probs = _top_k_filter(probs, torch.tensor(top_k, device=device))
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        probs = probs / probs.sum(dim=-1, keepdim=True)      # the nucleus of what min-p and top-k kept
        probs = _top_p_filter(probs, torch.tensor(top_p, device=device, dtype=torch.float32))
    return probs


def _min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero every token less likely than min_p times its row's top token (min_p 0: none). The
    top token always stays (min_p <= 1)."""
    floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return probs.masked_fill(probs < floor, 0.0)


def _top_k_filter(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k most probable tokens (k 0: all; a tie with the k-th is kept, as vLLM keeps
    it), zero the rest."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_p = torch.sort(probs, dim=-1, descending=True).values
    kth = sorted_p.gather(-1, (k - 1)[:, None])
    return probs.masked_fill(probs < kth, 0.0)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus: the fewest most-probable tokens with mass >= top_p.

    A token stays when the mass strictly before it (in descending order) is < top_p, so the
    top token always stays. The stable sort puts tied tokens in id order, so the cut is deterministic.
    """
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False     # the top token, even for a top_p that is 0 in float32 (1e-300)
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
