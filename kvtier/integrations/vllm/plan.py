"""What the scheduler-side connector tells the workers each step, and how both sides key a request.

Everything here is plain data (it is pickled to every worker each step) and imports no vLLM.

Keys: a request's prompt is keyed with kvtier's own chain (kvtier.keys.chain_keys) over its
full vLLM blocks, from the store's namespace seed. Requests whose KV differs for the same
tokens (a LoRA adapter, vLLM's per-tenant `cache_salt`) start their chain from a seed
derived from that tag, so they never share blocks with untagged requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.keys import BlockKeys, _hasher, chain_keys


def tagged_seed(seed: bytes, tag: bytes, hash_name: str) -> bytes:
    """The chain root for requests carrying `tag` (the store's seed itself when untagged)."""
    if not tag:
        return seed
    return _hasher(hash_name)(b"kvtier-vllm-tag-v1\0" + seed + tag)


def request_keys(tokens: list[int], block_tokens: int, seed: bytes, hash_name: str, tag: bytes = b"") -> BlockKeys:
    """Keys of the full blocks of `tokens` in the namespace of `seed`."""
    return chain_keys(tokens, block_tokens, tagged_seed(seed, tag, hash_name), hash_name)


@dataclass
class NewRequest:
    """A request a worker has not seen: the tokens of its prompt's full blocks and its tag."""

    req_id: str
    token_ids: list[int]
    tag: bytes = b""
    session: str | None = None          # pin the request's blocks under this session (x-session-affinity)
    ttl: float = 600.0


@dataclass
class Grown:
    """A running request's generated tokens that filled blocks past those the worker has
    keyed (the tokens of those whole blocks, in order)."""

    req_id: str
    token_ids: list[int]


@dataclass
class BlockRange:
    """Blocks [start, end) of a request's chain and the vLLM block ids (pages) that hold them."""

    req_id: str
    start: int
    end: int
    pages: list[int]


@dataclass
class StepPlan:
    """One step's work: requests to key, prefixes to load before the forward, blocks to save after."""

    new: list[NewRequest] = field(default_factory=list)
    grown: list[Grown] = field(default_factory=list)
    loads: list[BlockRange] = field(default_factory=list)
    saves: list[BlockRange] = field(default_factory=list)
    # Requests whose failed load the scheduler has handled (vLLM recomputes from the failed
    # block): their saves, skipped since the failure, may resume.
    resync: list[str] = field(default_factory=list)
    # Finished requests whose last blocks this step saves (vLLM keeps their pages until the
    # workers report them sent, after the save read them).
    final: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.new or self.grown or self.loads or self.saves or self.resync or self.final)
