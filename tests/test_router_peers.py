"""What the router reads from its workers and clients is bounded and survives bad bytes: a
worker answering its polls with something that is not a /kvtier/load object, a malformed
KV events batch, an endless or trickling answer, a session id of any size, a model id that
tries to climb out of /v1/models/. Workers here are scripted loopback servers; the router
runs in-process (its Router object) or as `kvtier router`."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Awaitable, Callable

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from fake_http import FakeServer, JsonHandler, ready  # noqa: E402

from kvtier.router import app as router_app  # noqa: E402
from kvtier.router import workers  # noqa: E402
from kvtier.router.app import Router, RouterConfig, _head  # noqa: E402
from kvtier.router.workers import Pools, Worker, read_small  # noqa: E402

BT = 16


class Scripted(FakeServer):
    """A worker whose GET answers are whatever `loads` says for that path (bytes, or a
    callable writing to the handler itself); it counts the GETs it served."""

    def __init__(self, answers: dict[str, object]) -> None:
        me = self
        self.answers = answers
        self.gets: dict[str, int] = {}

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                me.gets[path] = me.gets.get(path, 0) + 1
                answer = me.answers.get(path)
                if callable(answer):
                    answer(self)
                elif answer is None:
                    self.send_json({"error": "not found"}, 404)
                else:
                    self.send_json(answer)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_json({"count": 40})

        super().__init__(Handler)


@contextlib.asynccontextmanager
async def running(*workers: Worker, interval: float = 0.05) -> AsyncIterator[Router]:
    """A started Router over these decode workers, stopped at the end."""
    router = Router(Pools([], list(workers)), RouterConfig(poll_interval=interval))
    await router.start()
    try:
        yield router
    finally:
        await router.stop()


@contextlib.asynccontextmanager
async def serving(server: FakeServer) -> AsyncIterator[tuple[Router, httpx.AsyncClient]]:
    """A started Router over one decode worker, once it is ready, and an HTTP client to it."""
    async with running(Worker(server.url, "decode")) as router, httpx.AsyncClient(
            transport=httpx.ASGITransport(app=router_app.build_app(router)), base_url="http://router") as client:
        deadline = time.monotonic() + 30
        while not router.pools.decode[0].ready:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        yield router, client


def run(main: Callable[[], Awaitable[None]], *servers: FakeServer) -> None:
    """asyncio.run(main()), then stop the scripted workers whatever happened."""
    try:
        asyncio.run(main())
    finally:
        for s in servers:
            s.stop()


async def _polled(router: Router, server: Scripted, path: str, times: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    start = server.gets.get(path, 0)
    while server.gets.get(path, 0) < start + times:
        assert time.monotonic() < deadline, f"{path} polled {server.gets.get(path, 0) - start} times"
        assert not router._poller.done(), router._poller
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("load", [
    [1],                                                                  # not an object
    "ready",
    {"status": "ready", "block_tokens": "x", "pulled_bytes": [1], "pushed_bytes": {"a": 1}, "role": 5},
    {"status": ["ready"], "node": {"x": 1}},
])
def test_a_worker_answering_nonsense_to_its_polls_never_stops_the_router_polling(load):
    """A /kvtier/load answer that is not the object the router expects raised in the poll
    loop, which then ended for good: no worker was marked ready again."""
    bad = Scripted({"/kvtier/load": load})
    good = Scripted({"/kvtier/load": ready("both", BT)})

    async def main() -> None:
        async with running(Worker(bad.url, "decode"), Worker(good.url, "decode")) as router:
            await _polled(router, bad, "/kvtier/load", 3)
            good.answers["/kvtier/load"] = ready("both", BT, pulled_bytes=7)
            await _polled(router, good, "/kvtier/load", 2)
            b, g = router.pools.decode
            assert g.ready and g.pulled_bytes == 7
            assert b.block_tokens >= 1 and isinstance(b.pulled_bytes, int)
            assert b.role is None or isinstance(b.role, str)
            if not isinstance(load, dict) or not isinstance(load.get("status"), str):
                assert not b.ready

    run(main, bad, good)


@pytest.mark.parametrize("events", [
    {"events": [{"op": "+"}], "next": 1, "epoch": "e"},                   # an object per event
    {"events": [["+", "zz"]], "next": 1, "epoch": "e"},                   # not hex
    {"events": [5], "next": 1, "epoch": "e"},
])
def test_a_malformed_kv_events_batch_changes_nothing_and_polling_goes_on(events):
    w = Scripted({"/kvtier/load": ready("both", BT, kv_events=True), "/kvtier/events": events})

    async def main() -> None:
        async with running(Worker(w.url, "decode")) as router:
            await _polled(router, w, "/kvtier/events", 3)
            assert router.blocks.match(w.url, [bytes(16)]) == 0
            w.answers["/kvtier/events"] = {"events": [["+", "00" * 16]], "next": 1, "epoch": "e"}
            await _polled(router, w, "/kvtier/events", 2)
            assert router.blocks.match(w.url, [bytes(16)]) == 1      # a good batch after bad ones applies

    run(main, w)


def _endless(handler: JsonHandler) -> None:
    """A chunked answer that never ends (a megabyte a chunk) until the client goes away."""
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("transfer-encoding", "chunked")
    handler.end_headers()
    chunk = b"[" + b"1," * (1 << 19)
    try:
        for _ in range(1 << 12):                     # 4 GiB at most: the router must stop reading long before
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except OSError:
        pass
    handler.close_connection = True


def _trickle(handler: JsonHandler) -> None:
    """A byte every 0.2 s: each read arrives well within httpx's read timeout."""
    handler.send_response(200)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", "100000")
    handler.end_headers()
    try:
        for _ in range(100000):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.2)
    except OSError:
        pass
    handler.close_connection = True


@pytest.mark.parametrize("answer, error", [(_endless, workers.AnswerTooLarge), (_trickle, httpx.ReadTimeout)])
def test_a_small_call_reads_a_bounded_answer_in_a_bounded_time(answer, error):
    """httpx bounds each read, not an answer's size nor its total time."""
    w = Scripted({"/kvtier/load": answer})

    async def main() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            with pytest.raises(error):
                await asyncio.wait_for(read_small(client, "GET", w.url + "/kvtier/load", limit=1 << 20,
                                                  within=1.0), 60)

    run(main, w)


def test_a_worker_trickling_its_poll_answer_counts_as_unanswered():
    """A poll answered a byte at a time held every worker's poll (gathered together); now it
    ends at the poll's timeout and counts as unanswered, like a worker that is hung."""
    w = Scripted({"/kvtier/load": _trickle})
    worker = Worker(w.url, "decode")

    async def main() -> None:
        async with httpx.AsyncClient() as client:
            for _ in range(2):
                await asyncio.wait_for(workers._poll(client, worker), 60)

    old = workers.POLL_TIMEOUT_S
    workers.POLL_TIMEOUT_S = 0.5
    try:
        asyncio.run(main())
    finally:
        workers.POLL_TIMEOUT_S = old
        w.stop()
    assert worker.status == "down" and worker.unanswered == 2 and worker.lost.is_set()


def test_the_first_events_of_a_stream_are_found_however_it_is_cut():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\n\ndata: [DONE]\n\n'
    for size in (1, 2, 3, 7, len(stream)):
        async def chunks():
            for i in range(0, len(stream), size):
                yield stream[i:i + size]

        async def first(n: int) -> bytes:
            return await _head(chunks(), n)

        for n in (1, 2, 3):
            got = asyncio.run(first(n))
            assert got.count(b"\n\n") >= n or got == stream, (size, n, got)
            assert stream.startswith(got)
            # no more read than needed: at most one chunk past the n-th event's end
            ends, i = [], 0             # where each event ends, scanning as bytes.count does
            while (i := stream.find(b"\n\n", i)) >= 0:
                ends.append(i)
                i += 2
            assert len(got) < ends[n - 1] + 2 + size, (size, n, got)


def test_the_router_refuses_a_session_id_no_worker_would_take_and_keeps_model_ids_in_their_route():
    """A session id of any size was remembered (up to 100,000 of them); a model id with a
    decoded '../' reached other worker routes through GET /v1/models/{id}."""
    seen: list[str] = []

    class Worker_(JsonHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            seen.append(self.path)
            if self.path == "/kvtier/load":
                self.send_json(ready("both", BT))
            else:
                self.send_json({"id": self.path})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_json({"count": 40})

    w = FakeServer(Worker_)

    async def main() -> None:
        async with serving(w) as (router, client):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                                  headers={"x-session-affinity": "s" * 5000})
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-affinity"
            assert not router._sessions
            r = await client.get("/v1/models/..%2f..%2fkvtier%2fevents")
            assert r.status_code == 200
            assert not any(p.startswith("/kvtier/events") for p in seen), seen
            assert r.json()["id"].startswith("/v1/models/")

    run(main, w)


def test_an_endless_answer_from_a_decode_worker_is_a_502_not_the_routers_memory(monkeypatch):
    """A non-streamed completion and a forwarded /tokenize were read whole, however long."""
    monkeypatch.setattr(router_app, "ANSWER_MAX_BYTES", 4 << 20)

    class Worker_(JsonHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_json(ready("both", BT))

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            _endless(self)

    w = FakeServer(Worker_)

    async def main() -> None:
        async with serving(w) as (router, client):
            for path, body in (("/v1/completions", {"model": "m", "prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
                r = await asyncio.wait_for(client.post(path, json=body), 60)
                assert r.status_code == 502, (path, r.status_code, r.text[:200])
                message = r.json()["error"]["message"]
                assert "larger than 4,194,304 bytes" in message and w.url not in message   # no inner address
            assert router.stats.unserved == 1 and router.pools.decode[0].decode_seqs == 0    # load released
            assert router.pools.decode[0].ready          # an answer too large says nothing of the worker's health

    run(main, w)
