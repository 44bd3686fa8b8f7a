"""The router's routing rules (kvtier/router/rules.py) on scripted scenarios, its prefix
index, and the same rules in the cluster simulator."""
from __future__ import annotations

import pytest

from kvtier.router.prefixes import CHUNK, PrefixIndex, prompt_of
from kvtier.router.rules import AFFINITY_SLACK, Ask, Candidate, choose, cost

BT = 16


def cands(*rows: tuple[int, int, int]) -> list[Candidate]:
    """(prefix_tokens, prefill_tokens, decode_blocks) per worker, named w0, w1, ..."""
    return [Candidate(f"w{i}", *r) for i, r in enumerate(rows)]


def test_dynamo_cost_is_uncached_prefill_blocks_plus_decode_blocks():
    ask = Ask(1600, BT)
    # w0: 1,000 cached but 40 decode blocks; w1: nothing cached, idle
    ws = cands((1000, 0, 40), (0, 0, 0))
    assert cost(ws[0], ask, "dynamo") == (38 + 40) * BT               # 600 uncached tokens: 38 blocks
    assert cost(ws[1], ask, "dynamo") == 1600
    assert choose(ws, ask, "dynamo").name == "w0"          # 78 blocks < 100
    ws[0].decode_blocks = 70                                # now 108 > 100
    assert choose(ws, ask, "dynamo").name == "w1"
    ws[1].prefill_tokens = 800                              # queued prefill counts as prefill blocks
    assert choose(ws, ask, "dynamo").name == "w0"


def test_sglang_prefers_the_longest_prefix_until_the_load_gap_is_large():
    ask = Ask(1000, BT)
    ws = cands((900, 100, 0), (0, 60, 0))                  # gap 40 tokens: cache wins
    assert choose(ws, ask, "sglang").name == "w0"
    ws[0].prefill_tokens = 200                              # gap 140 > 64 and 200 > 1.5 x 60: least loaded
    assert choose(ws, ask, "sglang").name == "w1"
    ws[1].prefill_tokens = 150                              # gap 50 < 64: cache again
    assert choose(ws, ask, "sglang").name == "w0"
    low = cands((300, 0, 0), (0, 0, 0))                     # best prefix covers < half: least loaded (w0 ties first)
    assert choose(low, ask, "sglang").name == "w0"
    low[0].prefill_tokens = 10
    assert choose(low, ask, "sglang").name == "w1"


def test_kvtier_takes_the_longest_prefix_among_balanced_workers():
    ask = Ask(1000, BT)
    ws = cands((800, 0, 0), (0, 0, 0), (0, 0, 0))
    assert choose(ws, ask, "kvtier").name == "w0"
    ws[0].prefill_tokens = 3000          # after: 3200 vs 1000; mean 1333: w0 is out of balance
    assert choose(ws, ask, "kvtier").name == "w1"
    ws[1].decode_blocks = 10             # decode load counts in tokens (160): w2 is lighter
    assert choose(ws, ask, "kvtier").name == "w2"


def test_session_affinity_holds_within_its_load_bound():
    ask = Ask(1000, BT, session_worker="w1")
    ws = cands((0, 0, 0), (0, 500, 0))
    for policy in ("kvtier", "dynamo", "sglang"):
        assert choose(ws, ask, policy).name == "w1"
    ws[1].prefill_tokens = 1000 * 2 + AFFINITY_SLACK       # past 1.5 x best + slack: the rule decides
    for policy in ("kvtier", "dynamo", "sglang"):
        assert choose(ws, ask, policy).name == "w0"


def test_rules_refuse_nonsense():
    with pytest.raises(ValueError):
        choose([], Ask(10))
    with pytest.raises(ValueError):
        choose(cands((0, 0, 0)), Ask(10), "magic")


def test_prefix_index_matches_leading_chunks_per_worker():
    idx = PrefixIndex(capacity=1000)
    base = "system prompt " * 40
    a = prompt_of({"prompt": base + "question A"}, chat=False)
    b = prompt_of({"prompt": base + "another question"}, chat=False)
    idx.insert("w0", a)
    shared = len(base.encode()) // CHUNK * CHUNK
    assert idx.match("w0", b) == shared and idx.match("w1", b) == 0
    ids = prompt_of({"prompt": list(range(100))}, chat=False)
    assert ids.tokens == 100 and ids.tokens_of(ids.size, 0.1) == 100
    chat = prompt_of({"messages": [{"role": "user", "content": base}]}, chat=True)
    idx.insert("w1", chat)
    assert idx.match("w1", chat) == len(chat.hashes) * CHUNK
    small = PrefixIndex(capacity=2)
    small.insert("w0", a)
    assert small.match("w0", a) == 0                        # bounded: the oldest chunks are forgotten


def test_published_rules_in_the_simulator():
    from kvtier.sim.cluster import simulate
    from kvtier.traces.synthetic import AgenticConfig, synthetic_trace

    tr = synthetic_trace(AgenticConfig(seed=1, sessions=30))
    rows = {r: simulate(tr, r, 4, 200) for r in ("kv-aware", "dynamo", "sglang", "token-aware")}
    for r in ("dynamo", "sglang", "token-aware"):
        assert rows[r].load_imbalance < rows["kv-aware"].load_imbalance
        assert 0 < rows[r].prefix_hit_ratio <= 1


def test_a_worker_not_up_yet_is_no_warning_and_one_that_was_up_warns_down_and_back(caplog):
    """The router started beside its workers warned "unknown -> down" for each, and logged
    their coming up at INFO: at the default level a user saw every worker down, nothing else."""
    import asyncio

    import httpx

    from kvtier.router.workers import Pools, Worker

    up = {"now": False}

    def answer(request: httpx.Request) -> httpx.Response:
        if not up["now"]:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(200, json={"status": "ready", "role": "decode"})
    pools = Pools(decode=[Worker("http://127.0.0.1:1", "decode")])

    async def polls(states: list[bool]) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for s in states:
                up["now"] = s
                await pools.poll_once(client)
    with caplog.at_level("INFO", logger="kvtier.router"):
        asyncio.run(polls([False, False, True]))              # starting: down, then up
        quiet = [r for r in caplog.records if r.levelname == "WARNING"]
        assert quiet == [] and any("-> ready" in r.getMessage() for r in caplog.records)
        caplog.clear()
        asyncio.run(polls([False, True]))                     # was up: down and back, both warnings
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "ready -> down" in warned[0] and "down -> ready" in warned[1], warned


def test_a_worker_in_the_wrong_pool_is_down_and_warned_at_once(caplog):
    """`--prefill` and `--decode` swapped: the decode pool took the prefill worker and it
    answered every request itself (no hand-over), with nothing on stderr."""
    import asyncio

    import httpx

    from kvtier.router.workers import Pools, Worker

    def answer(request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.port == 8001 else "decode"
        return httpx.Response(200, json={"status": "ready", "role": role, "node": "127.0.0.1:9000"})
    pools = Pools(prefill=[Worker("http://127.0.0.1:8002", "prefill")],
                  decode=[Worker("http://127.0.0.1:8001", "decode")])

    async def poll() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await pools.poll_once(client)
            await pools.poll_once(client)
    with caplog.at_level("WARNING", logger="kvtier.router"):
        asyncio.run(poll())
    assert [w.status for w in pools.all] == ["down", "down"]
    assert pools.decode[0].error == "it runs --role prefill, not decode: give it to --prefill"
    assert pools.prefill[0].error == "it runs --role decode, not prefill: give it to --decode"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("unknown -> down (it runs --role" in m for m in warned), warned


def test_a_worker_never_reached_is_warned_of_once(caplog, monkeypatch):
    """A typo in a worker's URL showed only in /health ("starting"): the router had printed
    that it was ready and logged nothing."""
    import asyncio

    import httpx

    import kvtier.router.workers as workers
    from kvtier.router.workers import Pools, Worker

    monkeypatch.setattr(workers, "UNREACHED_WARN_S", 0.0)

    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)
    pools = Pools(decode=[Worker("http://127.0.0.1:8012", "decode")])

    async def polls() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for _ in range(3):
                await pools.poll_once(client)
    with caplog.at_level("WARNING", logger="kvtier.router"):
        asyncio.run(polls())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "http://127.0.0.1:8012 (decode) has not been ready" in warned[0], warned
    assert "ConnectError" in warned[0] and "check its URL" in warned[0]


def test_the_router_says_when_it_starts_and_stops_answering():
    """The router printed "ready" as it began to listen, before any worker was; it now says
    so when a decode worker is ready, and again when none is any longer."""
    import asyncio

    import httpx

    from kvtier.router.workers import Pools, Worker

    up = {"decode": False, "prefill": True}

    def answer(request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.port == 8001 else "decode"
        if not up[role]:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return httpx.Response(200, json={"status": "ready", "role": role, "node": "127.0.0.1:9000"})
    said: list[str] = []
    pools = Pools(prefill=[Worker("http://127.0.0.1:8001", "prefill")],
                  decode=[Worker("http://127.0.0.1:8002", "decode"), Worker("http://127.0.0.1:8003", "decode")],
                  announce=said.append)

    async def polls(decode_up: list[bool]) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            for s in decode_up:
                up["decode"] = s
                await pools.poll_once(client)
    asyncio.run(polls([False, False]))
    assert said == []                                    # the prefill worker alone answers nothing
    asyncio.run(polls([True, True, False, False, True]))
    assert said == ["ready: 2 of 2 decode and 1 of 1 prefill workers are ready; answering",
                    "no decode worker is ready: answering 503 until one is",
                    "ready: 2 of 2 decode and 1 of 1 prefill workers are ready; answering"], said
    # Calls that fail mark workers down between polls: a blip the next poll undoes says
    # nothing, and the loss a failed call found first is still said at the next poll.
    said.clear()
    for w in pools.decode:
        w.failed("ReadTimeout")
    asyncio.run(polls([True]))
    assert said == [], said
    for w in pools.decode:
        w.failed("ConnectError")
    asyncio.run(polls([False]))
    assert said == ["no decode worker is ready: answering 503 until one is"], said
