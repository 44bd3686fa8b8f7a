"""KV events: a server's log of its store's block events (kvtier/serve/events.py), the router's
view of each worker built from them (kvtier/router/blocks.py), and a router that routes by
what scripted workers report (a worker that evicted a prefix is no longer preferred)."""
from __future__ import annotations

import json
import time
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import kvtier
from kvtier.router.blocks import PENDING_S, BlockMap
from kvtier.serve.events import SNAPSHOT_TTL_S, KvEvents
from tests.conftest import payload
from tests.fake_http import FakeServer, JsonHandler, ready

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
NS = kvtier.Namespace("events-test", "r1")


def _put(store: kvtier.Store, first_token: int, blocks: int) -> list:
    keys = store.keys(list(range(first_token, first_token + 8 * blocks)))
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    return keys


def _hexes(keys) -> list[str]:
    return sorted(bytes(k).hex() for k in keys)


def test_the_event_log_numbers_bounds_and_snapshots():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS)
    first = _put(store, 0, 2)
    log = KvEvents(store, capacity=6)
    a = log.since(0)                                    # a new consumer: a snapshot of what the store holds
    assert a["reset"] is True and a["next"] == a["last"] == 0 and "cursor" not in a
    assert sorted(k for _, k in a["events"]) == _hexes(first) and {op for op, _ in a["events"]} == {"+"}
    e = a["epoch"]
    _put(store, 100, 4)                                 # 4 in, 2 evicted (capacity 4): 6 events
    b = log.since(a["next"], limit=3, epoch=e)
    assert b["reset"] is False and b["next"] == 3 and b["last"] == 6
    c = log.since(b["next"], epoch=e)
    ops = b["events"] + c["events"]
    assert sorted(op for op, _ in ops) == ["+"] * 4 + ["-"] * 2 and c["next"] == 6
    assert sorted(k for op, k in ops if op == "-") == _hexes(first)
    assert log.since(6, epoch=e)["events"] == [] and log.since(6, epoch=e)["reset"] is False
    now = _put(store, 200, 4)                           # 8 more events: number 6 is no longer kept
    stale = log.since(6, epoch=e)
    assert stale["reset"] is True and stale["first"] == 8 and stale["next"] == 14
    assert sorted(k for _, k in stale["events"]) == _hexes(now) == _hexes(store.cached_keys())
    assert log.since(14, epoch="another")["reset"] is True       # a number from another epoch: a snapshot
    assert log.since(14)["reset"] is False                        # without an epoch, a number is trusted
    with pytest.raises(ValueError):
        log.since(14, epoch=e, cursor="nonsense")
    assert KvEvents(store).epoch != e
    log.close()
    store.watch(feed="directory")                                          # feeds do not take each other's
    log2 = KvEvents(store)
    start = log2.since(0)
    fresh = _put(store, 300, 1)
    assert ("+", bytes(fresh[0])) in store.changes("directory")
    assert ["+", bytes(fresh[0]).hex()] in log2.since(start["next"], epoch=start["epoch"])["events"]


def test_a_feed_nobody_reads_stays_bounded_and_its_reader_starts_over(monkeypatch):
    """A watcher that stops reading (a router gone) costs at most FEED_LIMIT changes: past it
    the feed keeps none and says so (None); the event log then takes a new epoch, so its
    readers get a snapshot, and the directory publisher republishes everything."""
    import kvtier.store as store_module
    monkeypatch.setattr(store_module, "FEED_LIMIT", 5)
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS)
    log = KvEvents(store)
    start = log.since(0)
    store.watch(feed="directory")
    two = _put(store, 0, 2)
    assert sorted(store.changes("directory")) == sorted(("+", bytes(k)) for k in two)   # within the limit: kept
    held = _put(store, 100, 6)                                           # 6 more than the feed keeps
    assert len(store.index.changes or []) == 0 and store.index.changes.overflowed
    assert store.changes("directory") is None                            # start over from cached_keys()
    one = _put(store, 300, 1)
    assert store.changes("directory") == [("+", bytes(one[0]))]          # and then it goes on
    after = log.since(start["next"], epoch=start["epoch"])               # the log lost its thread:
    assert after["reset"] is True and after["epoch"] != start["epoch"]   # a snapshot of everything
    assert sorted(k for _, k in after["events"]) == _hexes(store.cached_keys())
    assert set(_hexes(held)) <= {k for _, k in after["events"]}
    log.close()
    store.close()


def _catch_up(m: BlockMap, log: KvEvents, worker: str = "w", page: int = 3, between=None) -> int:
    """Read `log` into `m` as the router does; `between()` runs after each answer. Answers read."""
    answers = 0
    while True:
        q = m.query(worker)
        more = m.apply(worker, log.since(q["since"], page, q.get("epoch"), q.get("cursor")))
        answers += 1
        if between is not None:
            between()
        if not more:
            return answers


def test_a_snapshot_pages_the_keys_and_the_changes_made_meanwhile_follow_it():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS)
    log = KvEvents(store, capacity=6)
    for i in range(5):                                  # 5 x 12 blocks through 16: far more events than 6
        _put(store, 1000 * i, 12)
    m = BlockMap()
    changes = iter(range(10_000, 10_000 + 8 * 2, 8))    # 2 x (1 in, 1 out): within the log

    def churn() -> None:                                # blocks stored and evicted while the router pages
        start = next(changes, None)
        if start is not None:
            _put(store, start, 1)
    assert _catch_up(m, log, between=churn) >= 6        # 16 keys in pages of 3, then the events since
    assert m.view("w")["blocks"] == len(store.cached_keys()) == 16 and m.view("w")["resets"] == 0
    assert all(m.match("w", [bytes(k)]) == 1 for k in store.cached_keys())
    # a router that fell further behind than the log holds gets a snapshot again
    _put(store, 50_000, 8)                              # 8 in, 8 out: 16 events
    _catch_up(m, log)
    assert m.view("w")["resets"] == 1 and m.view("w")["blocks"] == 16
    assert all(m.match("w", [bytes(k)]) == 1 for k in store.cached_keys())
    # a cursor of a snapshot no longer kept starts a new one from its first page
    q = log.since(0, 3)
    _put(store, 60_000, 8)                              # its continuation leaves the log: the snapshot goes
    again = log.since(0, 3, cursor=q["cursor"])
    assert again["reset"] is True and again["snapshot"]["offset"] == 0 and again["next"] > q["next"]
    # ... and so does one nobody read for SNAPSHOT_TTL_S (it is dropped: it holds every key)
    now = [0.0]
    timed = KvEvents(store, capacity=6, clock=lambda: now[0])
    page = timed.since(0, 3)
    assert timed.since(0, 3, cursor=page["cursor"])["snapshot"]["offset"] == 3
    now[0] += SNAPSHOT_TTL_S + 1
    assert timed.since(0, 3, cursor=page["cursor"])["reset"] is True


def test_block_map_follows_events_and_forgets_beliefs():
    now = [0.0]
    m = BlockMap(clock=lambda: now[0])
    keys = [bytes([i]) * 16 for i in range(4)]
    hexes = [k.hex() for k in keys]
    assert not m.knows("a") and m.match("a", keys) == 0 and m.query("a") == {"since": 0}
    more = m.apply("a", {"epoch": "e1", "next": 3, "last": 4, "events": [["+", h] for h in hexes[:3]]})
    assert more and m.knows("a") and m.match("a", keys) == 3
    m.apply("a", {"epoch": "e1", "next": 4, "last": 4, "events": [["-", hexes[1]]]})
    assert m.match("a", keys) == 1 and m.query("a") == {"since": 4, "epoch": "e1"}
    m.sent("a", keys)                                      # routed there: believed held for a while
    assert m.match("a", keys) == 4
    now[0] += PENDING_S + 1
    assert m.match("a", keys) == 1
    m.sent("a", keys)
    m.apply("a", {"epoch": "e1", "next": 5, "events": [["-", hexes[0]]]})     # an event settles a belief
    assert m.match("a", keys) == 0
    m.apply("a", {"epoch": "e2", "next": 1, "events": [["+", hexes[0]]]})     # restarted: afresh
    assert m.match("a", keys) == 1 and m.view("a")["resets"] == 1
    with pytest.raises(ValueError):
        m.apply("a", {"events": "nope"})


def test_beliefs_are_bounded_as_held_keys_are():
    """Every routed prompt's keys were believed held for PENDING_S, pruned only by a match
    past 4,096 of them: big prompts sent fast grew the router by their keys."""
    now = [0.0]
    m = BlockMap(capacity=100, clock=lambda: now[0])
    m.apply("a", {"epoch": "e1", "next": 0, "events": []})
    prompts = [[bytes([p, i]) * 8 for i in range(60)] for p in range(5)]
    for keys in prompts:
        m.sent("a", keys)
        assert len(m._workers["a"].pending) <= 100
    assert m.match("a", prompts[-1]) == 60                  # the newest beliefs stay
    assert m.match("a", prompts[0]) == 0                     # the oldest went first
    m = BlockMap(capacity=4, clock=lambda: now[0])
    m.apply("a", {"epoch": "e1", "next": 0, "events": []})
    root, a1, a2, b1 = (bytes([i]) * 16 for i in range(4))
    m.sent("a", [root])
    m.sent("a", [root, a1, a2])
    m.sent("a", [root])                                     # a hot prefix routed again: renewed
    m.sent("a", [root, b1])
    assert m.match("a", [root]) == 1 and m.match("a", [root, b1]) == 2   # trimmed: a tail, not the root


class FakeWorker(FakeServer):
    """A decode worker that publishes KV events, scripted or from a real `log` (in pages of
    `page`), and says who answered."""

    def __init__(self, name: str, keys: list[str], log: KvEvents | None = None, page: int = 3) -> None:
        self.name, self.events, self.served, self.keys = name, [], 0, keys
        me = self

        class Handler(JsonHandler):

            def do_GET(self) -> None:
                u = urlsplit(self.path)
                if u.path == "/kvtier/load":
                    self.send_json(ready("decode", 16, kv_events=True))
                elif log is not None:
                    q = {k: v[0] for k, v in parse_qs(u.query).items()}
                    self.send_json(log.since(int(q.get("since", 0)), page, q.get("epoch"), q.get("cursor")))
                else:
                    since = int(parse_qs(u.query).get("since", ["0"])[0])
                    ev = list(me.events)
                    self.send_json({"epoch": "e", "first": 0, "next": len(ev), "last": len(ev), "reset": False,
                                "events": ev[since:]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                if self.path == "/kvtier/keys":
                    self.send_json({"prompt_tokens": 16 * len(me.keys) + 1, "block_tokens": 16, "keys": me.keys})
                elif self.path == "/tokenize":
                    self.send_json({"count": len(body.get("prompt", "")) // 4})
                else:
                    me.served += 1
                    self.send_json({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": me.name}],
                                "usage": {"prompt_tokens": 16 * len(me.keys) + 1, "completion_tokens": 1}})

        super().__init__(Handler)


def test_routing_follows_what_the_workers_report():
    pytest.importorskip("uvicorn")
    from test_disagg import Router        # the router subprocess helper

    httpx = pytest.importorskip("httpx")
    keys = [bytes([i]) * 16 for i in range(20)]
    hexes = [k.hex() for k in keys]
    a, b = FakeWorker("A", hexes), FakeWorker("B", hexes)
    router = None
    try:
        router = Router("--decode", a.url, b.url)
        router.wait_ready(60)

        def complete() -> str:
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x" * 400, "max_tokens": 1},
                           timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def reported(worker: FakeWorker, blocks: int) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                views = {w["url"]: w.get("kv_events") for w in router.health().json()["workers"]}
                if views[worker.url] and views[worker.url]["blocks"] == blocks:
                    return
                time.sleep(0.1)
            raise AssertionError(router.health().text)

        b.events += [["+", h] for h in hexes]            # B holds the prompt's prefix; A does not
        reported(b, 20)
        assert complete() == "B"
        b.events += [["-", h] for h in hexes[5:]]        # B evicted most of it; A now holds all of it
        a.events += [["+", h] for h in hexes]
        reported(b, 5)
        reported(a, 20)
        assert complete() == "A"
        a.events += [["-", h] for h in hexes]            # A evicted it all: B's 5 blocks are the longest prefix
        reported(a, 0)
        assert complete() == "B"
        assert (a.served, b.served) == (1, 2)
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()


def test_a_router_starting_late_or_falling_behind_reads_a_snapshot():
    """A worker's log keeps 6 events; the router starts after 50 changes, then falls 16
    behind in one step: each time its view is the worker's store, key for key, read from a
    snapshot in pages of 3, and the prompt goes to the worker that holds it all."""
    pytest.importorskip("uvicorn")
    from test_disagg import Router

    httpx = pytest.importorskip("httpx")
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    log = KvEvents(store, capacity=6)
    for i in range(3):
        _put(store, 1000 * i, 8)                       # 24 in, 16 out: 40 events
    held = _put(store, 5000, 8)                        # a prompt's 8 blocks: all the store holds now
    a, b = FakeWorker("A", [bytes(k).hex() for k in held], log), FakeWorker("B", [])
    router = None
    try:
        router = Router("--decode", a.url, b.url)
        router.wait_ready(60)

        def view() -> dict:
            """The router's view of A once it has read A's log to its end."""
            end = log.since(log.next, epoch=log.epoch)["last"]     # the store's changes are in the log now
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                v = {w["url"]: w.get("kv_events") for w in router.health().json()["workers"]}[a.url]
                if v and v["next"] == end and not v["snapshot"]:
                    return v
                time.sleep(0.1)
            raise AssertionError(router.health().text)

        def complete() -> str:
            r = httpx.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x" * 400, "max_tokens": 1},
                           timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert view()["blocks"] == 8 and view()["resets"] == 0
        b.keys = a.keys
        b.events += [["+", h] for h in a.keys[:2]]    # B holds 2 of the prompt's blocks, A all 8
        assert complete() == "A"
        moved = _put(store, 9000, 8)                   # 8 in, 8 out at once: the router is 16 events behind
        a.keys = b.keys = [bytes(k).hex() for k in moved]
        b.events += [["+", h] for h in a.keys[:2]]
        v = view()
        assert v["blocks"] == 8 and v["resets"] == 1
        assert complete() == "A"
    finally:
        if router is not None:
            router.stop()
        a.stop()
        b.stop()
