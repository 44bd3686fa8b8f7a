"""Eviction and admission policies, selectable by name in the store and the CLI.

Names: "lru" (leaf-first LRU), "lfu", "s3fifo", "arc", "reuse" (reuse-protected LRU), each optionally followed by an
admission filter, "+nopartial" (e.g. "arc+nopartial"). "recommended" is DEFAULT_POLICY.
Belady ("belady") needs the trace's future: kvtier.sim builds it for replays only.
"""
from __future__ import annotations

from typing import Callable

from kvtier.errors import ConfigError
from kvtier.policies.admission import FILTERS, AdmissionFilter, NoPartial
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import BlockInfo, EvictionPolicy
from kvtier.policies.lfu import LFUPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.reuse import ReusePolicy
from kvtier.policies.s3fifo import S3FIFOPolicy

PolicyFactory = Callable[[int], EvictionPolicy]

#: name -> factory(capacity_blocks). Online policies only: the store may use any of them.
POLICIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "reuse": ReusePolicy,
}
#: The store's default: leaf-first LRU that never caches a partial last block. Measured
#: (docs/benchmarks.md) never below LRU by more than 0.0002 at 1-50% capacity on both
#: real traces; ARC variants gain more at small sizes but lose up to 0.02 at 25%.
#: Token-level keys have no partial blocks, so there it is exactly LRU.
DEFAULT_POLICY = "lru+nopartial"


def policy_names() -> list[str]:
    """Every name the store accepts: each policy alone and with each admission filter."""
    return [n for base in POLICIES for n in (base, *(f"{base}+{r}" for r in FILTERS))]


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make a policy selectable by name (e.g. Store(policy=name))."""
    POLICIES[name] = factory


def known_policy(name: str) -> bool:
    """Whether `name` is a registered policy with known admission filters ("POLICY+RULE...")."""
    base, *rules = name.split("+")
    return base in POLICIES and all(r in FILTERS for r in rules)


def unknown_policy(name: str, also: tuple[str, ...] = ("recommended",)) -> ConfigError:
    """The error for a policy name that is not known, listing what the caller accepts: the
    registry's names and `also` (a command that takes more names passes them)."""
    names = [*policy_names(), *(repr(a) for a in also)]
    return ConfigError(f"unknown policy {name!r}; choose one of {', '.join(names[:-1])} or {names[-1]} "
                       f"(filters: {', '.join(FILTERS)}, composed as 'arc+nopartial')")


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """A fresh policy instance for one tier of `capacity_blocks` blocks.

    Any registered name may take admission filters: "POLICY+RULE[+RULE...]".
    """
    if not isinstance(name, str):
        raise ConfigError(f"policy must be a name such as 'lru' or 'arc+nopartial', not {name!r}")
    if name == "recommended":
        name = DEFAULT_POLICY
    base, *rules = name.split("+")
    if base == "belady":
        raise ConfigError("policy 'belady' needs the future of a trace: it exists only in "
                          "`kvtier bench hit-ratio` (kvtier.sim.replay), never in a live store")
    if not known_policy(name):
        raise unknown_policy(name)
    pol = POLICIES[base](capacity_blocks)
    for r in rules:
        pol = FILTERS[r](pol)
    return pol


__all__ = ["AdmissionFilter", "ARCPolicy", "BlockInfo", "DEFAULT_POLICY", "EvictionPolicy", "FILTERS",
           "LFUPolicy", "LRUPolicy", "NoPartial", "POLICIES", "ReusePolicy", "S3FIFOPolicy", "known_policy",
           "make_policy", "policy_names", "register_policy", "unknown_policy"]
