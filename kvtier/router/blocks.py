"""What each worker really holds: block keys from the KV events the workers publish.

The router polls each ready worker's `GET /kvtier/events?since=N` (kvtier/serve/events.py)
and keeps, per worker, the keys of the blocks its store holds. For a request it asks one
worker for the prompt's block keys (`POST /kvtier/keys`: the workers key prompts exactly as
admission does), and a worker's cached prefix is the leading run of those keys it holds.
Where a worker publishes no events (an older server) or the keys could not be had, the
router falls back to its approximate text index (prefixes.py).

Between a request being sent and its blocks' events coming back (one poll), the keys sent
are believed held ("pending"), for at most PENDING_S; an event for a key settles it either
way. A router new to a worker, one whose worker restarted (another epoch) and one further
behind than the worker's log is answered a snapshot (`reset`, then pages of the keys held,
then the events since it was taken) and starts that worker's view afresh. Bounded: at most
`capacity` keys per worker (the oldest reported forgotten first), and as many beliefs.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

PENDING_S = 5.0              # seconds a routed request's keys count as held before events confirm them
DEFAULT_CAPACITY = 1 << 20   # keys per worker (~100 MB at most for a million blocks)
MAX_ROUNDS = 8               # event batches read per worker per poll


@dataclass
class WorkerBlocks:
    """One worker's blocks as its events report them."""

    epoch: str | None = None
    next: int = 0                                  # the next event number to ask for
    cursor: str | None = None                      # the next snapshot page to ask for, while reading one
    held: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    pending: dict[bytes, float] = field(default_factory=dict)   # key -> when the belief expires
    events: int = 0                                # events applied
    resets: int = 0


class BlockMap:
    """Per worker, the block keys it holds (from its events), and the prefix match."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.clock = clock
        self._workers: dict[str, WorkerBlocks] = {}

    def knows(self, worker: str) -> bool:
        """Whether `worker` publishes events this router has read."""
        return worker in self._workers

    def query(self, worker: str) -> dict[str, Any]:
        """The parameters of the next `GET /kvtier/events` to `worker`."""
        w = self._workers.get(worker)
        if w is None or w.epoch is None:
            return {"since": 0}                    # new to it: a snapshot
        return {"since": w.next, "epoch": w.epoch, **({"cursor": w.cursor} if w.cursor else {})}

    def apply(self, worker: str, answer: Any) -> bool:
        """Apply one `/kvtier/events` answer; True if more events are waiting. A malformed
        answer raises ValueError (the caller treats the worker as publishing none)."""
        if not isinstance(answer, dict) or not isinstance(answer.get("events"), list) \
                or not isinstance(answer.get("next"), int) or not isinstance(answer.get("epoch"), str):
            raise ValueError("not a /kvtier/events answer")
        try:                       # all read before any is applied: a bad one changes nothing
            events = [(op, bytes.fromhex(key)) for op, key in answer["events"] if op in ("+", "-")]
        except (TypeError, ValueError) as e:     # not ["+" | "-", hex] pairs
            raise ValueError(f"malformed /kvtier/events entry: {e}") from None
        w = self._workers.setdefault(worker, WorkerBlocks())
        if answer["epoch"] != w.epoch or answer.get("reset"):
            if w.epoch is not None:
                w.resets += 1
            w.held.clear()
            w.pending.clear()
            w.epoch = answer["epoch"]
        held, pending = w.held, w.pending
        for op, key in events:
            pending.pop(key, None)
            if op == "+":
                held[key] = None
                held.move_to_end(key)
            else:
                held.pop(key, None)
        while len(held) > self.capacity:
            held.popitem(last=False)
        w.events += len(answer["events"])
        w.next = answer["next"]
        w.cursor = answer.get("cursor") if isinstance(answer.get("cursor"), str) else None
        return w.cursor is not None or isinstance(answer.get("last"), int) and answer["last"] > w.next

    def sent(self, worker: str, keys: Sequence[bytes]) -> None:
        """A request with these keys went to `worker`: believe them held until events say."""
        w = self._workers.get(worker)
        if w is None:
            return
        now = self.clock()
        until = now + PENDING_S
        pending, held = w.pending, w.held
        # Tail first and renewed at the end: trimmed oldest first, a prompt loses its tail
        # before its root (a match stops at the first key missing)
        for k in reversed(keys):
            if k not in held:
                pending.pop(k, None)
                pending[k] = until
        if len(pending) > self.capacity:   # bounded as `held` is (a client's prompts add 1 key per block)
            w.pending = pending = {k: t for k, t in pending.items() if t > now}
            for k in list(itertools.islice(pending, len(pending) - self.capacity)):
                del pending[k]

    def match(self, worker: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` `worker` holds (or was just sent)."""
        w = self._workers.get(worker)
        if w is None:
            return 0
        now, n = self.clock(), 0
        for k in keys:
            if k in w.held or w.pending.get(k, 0.0) > now:
                n += 1
            else:
                break
        if len(w.pending) > 4096:                  # expired beliefs go now and then
            w.pending = {k: t for k, t in w.pending.items() if t > now}
        return n

    def view(self, worker: str) -> dict[str, Any] | None:
        w = self._workers.get(worker)
        if w is None:
            return None
        return {"blocks": len(w.held), "events": w.events, "next": w.next, "resets": w.resets,
                "snapshot": w.cursor is not None}
