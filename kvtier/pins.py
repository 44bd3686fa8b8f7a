"""Session pins: which blocks must stay in a tier or above, for whom, until when.

A pin names a session's keys and a tier (its floor). A key pinned by several sessions
keeps the highest floor among them and counts once against that tier's pinned budget
(`pin_budget` x capacity); a pin holds only the longest prefix of its keys that fits.
Keys not cached yet are protected once they arrive. Expiry is checked lazily on each
call, against an injectable clock. The BlockIndex consults `floor()` when it picks
victims; it never evicts a pinned block's last copy out of its floor.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.errors import ConfigError
from kvtier.ids import IndexKey as Key

UNPINNED = 1 << 30      # the floor of a key nobody pins: below every tier


@dataclass(slots=True)
class PinRecord:
    keys: list[Key]
    tier: int
    expires: float


class Pins:
    """Every live pin of one index, and the floor each pinned key gets from them."""

    def __init__(self, capacities: Sequence[int], pin_budget: float, clock: Callable[[], float],
                 ref_limit: int | None = None) -> None:
        if isinstance(pin_budget, bool) or not isinstance(pin_budget, (int, float)) or not 0.0 <= pin_budget <= 0.9:
            raise ConfigError(f"pin_budget is the fraction of each tier that pins may hold, in [0, 0.9] "
                              f"(pins must never starve the store), got {pin_budget!r}")
        self.capacities = list(capacities)
        self.pin_budget = pin_budget
        self.clock = clock
        self.pinned = [0] * len(self.capacities)     # distinct keys with each tier as their floor
        self._pins: dict[str, PinRecord] = {}
        self._pinners: dict[Key, dict[str, int]] = {}
        # key -> how many sessions pin it to each tier: its floor in O(tiers) when one leaves
        # (min over its pinners was O(sessions): 20,000 sessions on one prefix, quadratic)
        self._tiers: dict[Key, list[int]] = {}
        self._floor: dict[Key, int] = {}             # key -> highest tier it must stay in or above
        self._expiry: list[tuple[float, str]] = []
        # Session pins are bounded as a whole: every session id a client sends (the affinity
        # header) keeps a record of its keys for the TTL, shared keys included (20,000 sessions
        # on one 256-block prefix held 155 MB). Past `ref_limit` keys over all records, the
        # pins nearest their expiry go first (`shed` counts them).
        self.ref_limit = ref_limit if ref_limit is not None else max(1 << 20, 4 * sum(self.capacities))
        self.refs = 0
        self.shed = 0

    def floor(self, key: Key) -> int:
        """The highest tier `key` must stay in or above (UNPINNED if none)."""
        return self._floor.get(key, UNPINNED)

    def __contains__(self, key: Key) -> bool:
        return key in self._floor

    def pin(self, session: str, keys: Sequence[Key], ttl: float, tier: int = 0) -> int:
        """Keep `keys` in `tier` or above until `ttl` seconds pass or unpin(session); pins the
        longest prefix that fits the tier's budget and returns its length. Pinning a session
        again replaces its previous pin."""
        if not 0 <= tier < len(self.capacities):
            raise ConfigError(f"pin tier {tier} out of range: the store has {len(self.capacities)} tiers")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf:
            raise ConfigError(f"ttl must be a finite number of seconds > 0, got {ttl!r}")
        self.expire()
        budget = int(self.pin_budget * self.capacities[tier])
        rec = self._pins.get(session)
        n = len(rec.keys) if rec is not None else 0
        if (rec is not None and rec.tier == tier and self.pinned[tier] <= budget and len(keys) >= n
                and list(keys[:n]) == rec.keys):
            # Speed: the session's longer chain (its next turn, its answer's blocks) keeps
            # what is pinned and adds the rest: 3 ms for 4,000 keys (a 64k-token context)
            # again every time a block grew. Unpin-then-pin arrives at the same state unless
            # the tier is over its budget (another session's unpin can lower a shared key's
            # floor into it): then those keys are pinned afresh.
            pinned, keys, counted = rec.keys, keys[n:], n
        else:
            self.unpin(session)
            pinned, counted = [], 0
        for k in keys:
            if session in self._pinners.get(k, ()):
                continue            # a key listed twice is pinned once
            old = self._floor.get(k, UNPINNED)
            if old > tier:
                if self.pinned[tier] + 1 > budget:
                    break
                self.pinned[tier] += 1
                if old != UNPINNED:
                    self.pinned[old] -= 1
                self._floor[k] = tier
            self._pinners.setdefault(k, {})[session] = tier
            counts = self._tiers.get(k)
            if counts is None:
                counts = self._tiers[k] = [0] * len(self.capacities)
            counts[tier] += 1
            pinned.append(k)
        expires = self.clock() + ttl
        self.refs += len(pinned) - counted
        self._pins[session] = PinRecord(pinned, tier, expires)
        heapq.heappush(self._expiry, (expires, session))
        if len(self._expiry) > 2 * len(self._pins) + 64:
            # each re-pin leaves its old entry behind until it expires (a session re-pinned
            # every turn left rate x TTL of them): rebuild from the live records when stale
            # entries outnumber live ones, O(1) amortised per pin
            self._expiry = [(r.expires, s) for s, r in self._pins.items()]
            heapq.heapify(self._expiry)
        if self.refs > self.ref_limit:
            self._shed(session)
        return len(pinned)

    def _shed(self, keep: str) -> None:
        """Unpin the sessions nearest their expiry (not `keep`) until within ref_limit."""
        exp, kept = self._expiry, []
        while self.refs > self.ref_limit and exp:
            expires, session = heapq.heappop(exp)
            rec = self._pins.get(session)
            if rec is None or rec.expires != expires:
                continue                   # re-pinned or gone since: a stale entry
            if session == keep:
                kept.append((expires, session))
                continue
            self.unpin(session)
            self.shed += 1
        for item in kept:
            heapq.heappush(exp, item)

    def unpin(self, session: str) -> int:
        """Release a session's pin; returns how many keys it had pinned (0 if none)."""
        rec = self._pins.pop(session, None)
        if rec is None:
            return 0
        self.refs -= len(rec.keys)
        for k in rec.keys:
            who = self._pinners[k]
            counts = self._tiers[k]
            counts[who.pop(session)] -= 1
            old = self._floor[k]
            new = next((t for t, c in enumerate(counts) if c), UNPINNED)
            if not who:
                del self._pinners[k]
                del self._tiers[k]
            if new != old:
                self.pinned[old] -= 1
                if new == UNPINNED:
                    del self._floor[k]
                else:
                    self.pinned[new] += 1
                    self._floor[k] = new
        return len(rec.keys)

    def expire(self) -> None:
        """Drop pins whose TTL has passed."""
        exp = self._expiry
        if not exp or exp[0][0] > self.clock():
            return
        now = self.clock()
        while exp and exp[0][0] <= now:
            expires, session = heapq.heappop(exp)
            rec = self._pins.get(session)
            if rec is not None and rec.expires == expires:   # not re-pinned since
                self.unpin(session)

    def keys(self) -> int:
        """How many distinct keys are pinned."""
        return len(self._floor)

    def count(self) -> int:
        """How many sessions hold a pin."""
        return len(self._pins)

    def sessions(self) -> dict[str, PinRecord]:
        return dict(self._pins)
