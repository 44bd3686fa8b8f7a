"""KV events: a server's log of its store's block events (kvtier/serve/events.py), the router's
view of each worker built from them (kvtier/router/blocks.py), and a router that routes by
what scripted workers report (a worker that evicted a prefix is no longer preferred)."""
from __future__ import annotations

import http.server
import json
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

import kvtier
from kvtier.router.blocks import PENDING_S, BlockMap
from kvtier.serve.events import KvEvents
from tests.conftest import payload

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
NS = kvtier.Namespace("events-test", "r1")


def test_the_event_log_numbers_bounds_and_resets():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS)
    first = store.keys(list(range(8 * 2)))
    store.put(first, payload(first, LAYOUT.block_bytes))
    log = KvEvents(store, capacity=6)
    a = log.since(0)
    assert a["reset"] is False and a["next"] == a["last"] == 2
    assert sorted(a["events"]) == sorted(["+", bytes(k).hex()] for k in first)   # what it held when the log began
    more = store.keys(list(range(100, 100 + 8 * 4)))
    store.put(more, payload(more, LAYOUT.block_bytes))                     # 4 in, 2 evicted (capacity 4)
    b = log.since(a["next"], limit=3)
    assert [op for op, _ in b["events"]].count("+") >= 1 and b["next"] == 5 and b["last"] == 8
    c = log.since(b["next"])
    ops = b["events"] + c["events"]
    assert sorted(op for op, _ in ops) == ["+"] * 4 + ["-"] * 2 and c["next"] == 8
    assert {k for op, k in ops if op == "-"} == {bytes(k).hex() for k in first}
    stale = log.since(0)                                                   # fell behind the 6 kept
    assert stale["reset"] is True and stale["first"] == 2 and stale["next"] == 8
    other = log.since(99)                                                  # a number from another epoch
    assert other["reset"] is True and other["epoch"] == a["epoch"]
    assert KvEvents(store).epoch != a["epoch"]
    log.close()
    store.watch(feed="directory")                                          # feeds do not take each other's
    fresh = store.keys(list(range(300, 308)))
    log2 = KvEvents(store)
    start = log2.since(0)["next"]
    store.put(fresh, payload(fresh, LAYOUT.block_bytes))
    assert ("+", bytes(fresh[0])) in store.changes("directory")
    assert ["+", bytes(fresh[0]).hex()] in log2.since(start)["events"]


def test_block_map_follows_events_and_forgets_beliefs():
    now = [0.0]
    m = BlockMap(clock=lambda: now[0])
    keys = [bytes([i]) * 16 for i in range(4)]
    hexes = [k.hex() for k in keys]
    assert not m.knows("a") and m.match("a", keys) == 0
    more = m.apply("a", {"epoch": "e1", "next": 3, "last": 4, "events": [["+", h] for h in hexes[:3]]})
    assert more and m.knows("a") and m.match("a", keys) == 3
    m.apply("a", {"epoch": "e1", "next": 4, "last": 4, "events": [["-", hexes[1]]]})
    assert m.match("a", keys) == 1 and m.since("a") == 4
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


class FakeWorker:
    """A decode worker that publishes scripted KV events and says who answered."""

    def __init__(self, name: str, keys: list[str]) -> None:
        self.name, self.events, self.served = name, [], 0
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                u = urlsplit(self.path)
                if u.path == "/kvtier/load":
                    self._send({"role": "decode", "status": "ready", "node": "127.0.0.1:1", "block_tokens": 16,
                                "kv_events": True})
                else:
                    since = int(parse_qs(u.query).get("since", ["0"])[0])
                    ev = list(me.events)
                    self._send({"epoch": "e", "first": 0, "next": len(ev), "last": len(ev), "reset": False,
                                "events": ev[since:]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                if self.path == "/kvtier/keys":
                    self._send({"prompt_tokens": 16 * len(keys) + 1, "block_tokens": 16, "keys": keys})
                elif self.path == "/tokenize":
                    self._send({"count": len(body.get("prompt", "")) // 4})
                else:
                    me.served += 1
                    self._send({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": me.name}],
                                "usage": {"prompt_tokens": 16 * len(keys) + 1, "completion_tokens": 1}})

            def log_message(self, *a) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
