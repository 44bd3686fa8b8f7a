"""Admission filters: wrap any eviction policy and refuse some new blocks outright.

"nopartial" never caches a request's partial last block: on the real traces 0.7% of
partial blocks are ever reused against 26% of full blocks, so a partial block mostly
evicts something useful. Compose by name: "lru+nopartial", "arc+nopartial", ...
"""
from __future__ import annotations

from typing import Callable, Sequence

from kvtier.ids import IndexKey as Key
from kvtier.policies.base import BlockInfo, EvictionPolicy


class AdmissionFilter(EvictionPolicy):
    """An eviction policy plus a rule that can refuse a block before it is cached."""

    rule: str = "filter"

    def __init__(self, inner: EvictionPolicy) -> None:
        super().__init__(inner.capacity_blocks)
        self.inner = inner
        self.name = f"{inner.name}+{self.rule}"   # type: ignore[misc]  # per instance
        self.offline = inner.offline              # type: ignore[misc]

    def begin_request(self, i: int) -> None:
        self.inner.begin_request(i)

    def refuse(self, info: BlockInfo) -> bool:
        raise NotImplementedError

    def admit(self, info: BlockInfo) -> bool:
        return not self.refuse(info) and self.inner.admit(info)

    def insert(self, info: BlockInfo) -> None:
        self.inner.insert(info)

    def touch(self, keys: Sequence[Key]) -> None:
        self.inner.touch(keys)

    def remove(self, key: Key) -> None:
        self.inner.remove(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        return self.inner.victim(evictable)

    def victims(self, kind: Callable[[Key], int], n: int) -> list[Key] | None:
        return self.inner.victims(kind, n)

    def order(self) -> list[Key] | None:
        return self.inner.order()

    def __len__(self) -> int:
        return len(self.inner)


class NoPartial(AdmissionFilter):
    """Never cache a block holding fewer than block_tokens tokens."""

    rule = "nopartial"

    def refuse(self, info: BlockInfo) -> bool:
        return info.tokens < info.block_tokens


#: rule name -> wrapper class, for "policy+rule" names.
FILTERS: dict[str, type[AdmissionFilter]] = {"nopartial": NoPartial}
