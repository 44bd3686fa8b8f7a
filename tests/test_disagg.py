"""Prefill/decode disaggregation end to end, on loopback: a router started before its
workers, a prefill and a decode worker (`kvtier serve --role ...`) linked by their kvtier
nodes, against one `both` server as the reference; faults (a prefill worker that dies
mid-request, none left, a decode worker that cannot fetch the KV); bad input. Every process
a test starts is stopped by it (module fixtures stop theirs at the end)."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import assert_one_line_error, child_env, run_kvtier  # noqa: E402
from test_serve import JSON_TYPE, MODEL, STARTUP_S, Server, _free_port  # noqa: E402
from fake_http import FakeServer, JsonHandler, ready  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BT = 16
HANDOFF_TTL = 6          # seconds the prefill worker keeps a hand-over's blocks pinned
SECRET = b"0123456789abcdef-pd-test-secret"   # the workers' --secret-file
PROMPT = ("The agent's shared system prompt: you can call tools, read files and answer. " * 4) + "Turn 1."


class Router:
    """One `kvtier router` subprocess."""

    def __init__(self, *args: str, port: int = 0) -> None:
        env = child_env()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "router", "--host", "127.0.0.1",
                                      "--port", str(port), "--poll-interval", "0.2", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("kvtier router: listening on "), line
        self.url = line.split(" on ", 1)[1].split()[0]
        self.lines: list[str] = []           # its log, drained as it comes
        threading.Thread(target=lambda: [self.lines.append(x) for x in self.proc.stdout], daemon=True).start()

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)

    def wait_ready(self, timeout: float = STARTUP_S) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health().json()
            if h["status"] == "ready" and h["calibrated"] and all(w["status"] == "ready" for w in h["workers"] if "fake" not in w["url"]):
                return self
            time.sleep(0.2)
        raise AssertionError(self.health().text)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM, as an operator stops it; its exit status (killed if it outlives `timeout`)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(router, prefill, decode, reference): the router starts first, then its workers."""
    secret = tmp_path_factory.mktemp("pd") / "secret"
    secret.write_bytes(SECRET)
    pp, dp = _free_port(), _free_port()
    while dp == pp:                            # a port just freed may be handed out again
        dp = _free_port()
    started: list = []
    try:
        router = Router("--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}")
        started.append(router)
        early = router.health()
        # the prefill worker's caches are small (102 blocks) so a test can overflow them
        started += [_on_port(pp, "--role", "prefill", "--secret-file", str(secret), "--kv-cache", "2MiB",
                             "--host-cache", "2MiB", "--handoff-ttl", str(HANDOFF_TTL)),
                    _on_port(dp, "--role", "decode", "--secret-file", str(secret)), Server()]
        p, d, ref = (s.wait_ready() for s in started[1:])
        router.wait_ready()
        yield router, p, d, ref, early
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def pd_push(pd):
    """A second router over the same workers, with --handoff push."""
    _, p, d, *_ = pd
    router = Router("--prefill", p.url, "--decode", d.url, "--handoff", "push")
    try:
        yield router.wait_ready()
    finally:
        router.stop()


def _on_port(port: int, *args: str) -> Server:
    s = Server.__new__(Server)
    env = child_env(OMP_NUM_THREADS="1")
    s.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--model", MODEL, "--kv-cache", "4MiB", "--host-cache", "8MiB", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    s.lines, s.url, s._ready = [], "", threading.Event()
    threading.Thread(target=s._read, daemon=True).start()
    return s


def _sse(url: str, body: dict) -> tuple[str, list[str], dict | None]:
    """A raw streamed completion: (text, the data lines, usage)."""
    text, lines, usage = "", [], None
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line[6:] != "[DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk.get("usage") or usage
    return text, lines, usage


def _body(prompt: str, n: int = 12) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}


def _complete(client: openai.OpenAI, prompt: str, n: int = 12):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True})


def _full_blocks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BT * BT


def _load(server) -> dict:
    return httpx.get(server.url + "/kvtier/load", timeout=10).json()


def _wrapped(server, route: str, body: dict) -> dict:
    r = httpx.post(server.url + route, json={"api": "completions", "request": body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _held(server, keys: list[str]) -> int:
    """How many leading `keys` the server's KV events say it holds (read as a router reads them)."""
    from kvtier.router.blocks import BlockMap

    m = BlockMap()
    while m.apply(server.url, httpx.get(server.url + "/kvtier/events", params=m.query(server.url), timeout=10).json()):
        pass
    return m.match(server.url, [bytes.fromhex(k) for k in keys])


def _hand(node: str, keys: list[str]) -> dict:
    """A hand-over as a prefill worker of the test cluster signs it."""
    from kvtier.serve.roles import HANDOFF, sign, signing_key

    return {"node": node, "keys": keys,
            "signature": sign(signing_key(SECRET), HANDOFF, node, [bytes.fromhex(k) for k in keys])}


def _remote_tokens(server, body: dict) -> int:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["kvtier_cached_by_tier"]["remote"]


# -- the hand-over ---------------------------------------------------------------------------


def test_router_reports_workers_before_they_are_up(pd):
    *_, early = pd
    assert early.status_code == 503
    body = early.json()
    assert body["status"] == "starting" and {w["pool"] for w in body["workers"]} == {"prefill", "decode"}


def test_handed_over_blocks_stay_pinned_on_the_prefill_worker_until_the_ttl(pd):
    """First to use the prefill worker: no earlier hand-over's pin takes its pin budget."""
    _, p, d, _, _ = pd
    loose = _body("[Turn 0 (computed, not handed over)] " + PROMPT, 1)
    assert httpx.post(p.url + "/v1/completions", json=loose, timeout=120).status_code == 200
    pinned = _body("[Turn 0 (handed over)] " + PROMPT)
    hand = _wrapped(p, "/kvtier/prefill", pinned)
    n = len(hand["keys"])
    assert n and _load(p)["pinned_blocks"] == n
    for i in range(3):        # 3 x 44 blocks through a 102-block store: every unpinned block is evicted
        flood = _body([1 + (i * 131 + j * 7) % 500 for j in range(700)], 1)
        assert httpx.post(p.url + "/v1/completions", json=flood, timeout=120).status_code == 200
    # the decode worker still pulls the handed-over prompt whole; the other one is gone
    assert _remote_tokens(d, {**pinned, "kvtier_handoff": _hand(hand["node"], hand["keys"])}) == n * BT
    loose_keys = _wrapped(p, "/kvtier/keys", loose)["keys"]
    assert len(loose_keys) >= n
    assert _remote_tokens(d, {**loose, "kvtier_handoff": _hand(hand["node"], loose_keys)}) == 0
    deadline = time.monotonic() + HANDOFF_TTL + 10                # released on expiry
    while _load(p)["pinned_blocks"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _load(p)["pinned_blocks"] == 0


def test_pd_answers_like_one_server_with_the_prefix_from_remote(pd):
    router, _, d, ref, _ = pd
    want = _complete(ref.client(), PROMPT)
    got = _complete(router.client(), PROMPT)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    details = got.usage.prompt_tokens_details
    assert details.cached_tokens == _full_blocks(got.usage.prompt_tokens) > 0      # already on the first request
    assert details.model_extra["kvtier_cached_by_tier"]["remote"] == details.cached_tokens
    # streamed: one response, one [DONE], the same text, usage from remote
    prompt2 = "[Turn 2 (streamed)] " + PROMPT
    want2 = _complete(ref.client(), prompt2).choices[0].text
    text, lines, usage = _sse(router.url, _body(prompt2))
    assert text == want2 and lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    assert len({json.loads(x)["id"] for x in lines[:-1]}) == 1
    assert usage["prompt_tokens_details"]["kvtier_cached_by_tier"]["remote"] == _full_blocks(usage["prompt_tokens"])
    load = httpx.get(d.url + "/kvtier/load", timeout=10).json()
    assert load["role"] == "decode" and load["pulled_blocks"] > 0 and load["pulled_bytes"] > 0
    health = router.health().json()
    assert health["stats"]["disaggregated"] >= 2 and health["stats"]["unserved"] == 0
    # the decode worker's KV events report the pulled blocks, under the keys any worker gives the prompt
    keys = _wrapped(d, "/kvtier/keys", _body(prompt2))["keys"]
    assert keys == _wrapped(ref, "/kvtier/keys", _body(prompt2))["keys"]
    assert len(keys) == _full_blocks(usage["prompt_tokens"]) // BT and _held(d, keys) == len(keys)
    bad = httpx.get(d.url + "/kvtier/events", params={"since": 0, "cursor": "not-a-cursor"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"
    deadline = time.monotonic() + 10                  # and the router reads them
    while not all(w.get("kv_events", {}).get("blocks") for w in router.health().json()["workers"]):
        assert time.monotonic() < deadline, router.health().text
        time.sleep(0.2)


def test_push_handoff_answers_like_one_server_with_the_prefix_in_the_decode_workers_tier(pd, pd_push):
    _, p, d, ref, _ = pd
    pulled = _load(d)["pulled_blocks"]
    prompt = "[Turn 6 (pushed)] " + PROMPT
    want = _complete(ref.client(), prompt)
    got = _complete(pd_push.client(), prompt)
    assert got.choices[0].text == want.choices[0].text
    details = got.usage.prompt_tokens_details
    n = _full_blocks(got.usage.prompt_tokens)
    by_tier = details.model_extra["kvtier_cached_by_tier"]
    assert details.cached_tokens == n > 0 and by_tier["device"] == n and by_tier["remote"] == 0   # the receiving tier
    stats = pd_push.health().json()["stats"]
    block_bytes = _load(d)["block_bytes"]
    assert stats["disaggregated"] == 1 and stats["pushed_bytes"] == n // BT * block_bytes and stats["push_failures"] == 0
    assert _load(p)["pushed_blocks"] >= n // BT and _load(d)["pulled_blocks"] == pulled     # nothing was pulled
    # streamed: the same text, one [DONE]
    prompt2 = "[Turn 6 (pushed, streamed)] " + PROMPT
    want2 = _complete(ref.client(), prompt2).choices[0].text
    text, lines, usage = _sse(pd_push.url, _body(prompt2))
    assert text == want2 and lines.count("[DONE]") == 1
    assert usage["prompt_tokens_details"]["kvtier_cached_by_tier"]["device"] == _full_blocks(usage["prompt_tokens"])


def test_pd_chat_matches_one_server(pd):
    router, _, _, ref, _ = pd
    msgs = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Which tool first?"}]
    want = ref.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    got = router.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens_details.model_extra["kvtier_cached_by_tier"]["remote"] > 0
    chunks = list(router.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                          stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content


def test_short_prompts_go_straight_to_decode_and_bad_requests_pass_through(pd):
    router, *_ = pd
    before = router.health().json()["stats"]["direct"]
    out = _complete(router.client(), "Hi", 4)
    assert out.usage.completion_tokens == 4
    assert router.health().json()["stats"]["direct"] == before + 1
    r = httpx.post(router.url + "/v1/completions", json={**_body(PROMPT), "temperature": 7}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=60, headers=JSON_TYPE)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # nested deeper than the router can write back (a 500 and a logged traceback before); 254 levels pass
    deep = b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}'
    for levels, status in ((300, 400), (252, 400), (240, 400)):   # + the body's own 3 levels; 243: the worker's 400
        r = httpx.post(router.url + "/v1/chat/completions", timeout=60, headers=JSON_TYPE,
                       content=deep % (MODEL.encode(), b"[" * levels + b"]" * levels))
        assert r.status_code == status, r.text
        assert ("nests deeper than 254" in r.text) == (levels > 251), r.text
        assert ("messages[0].content" in r.text) == (levels == 240), r.text


# -- faults ----------------------------------------------------------------------------------


class FakePrefill(FakeServer):
    """A worker that looks ready but dies mid-request: it reads a prefill request and drops
    the connection without answering (as a crashed process does)."""

    def __init__(self) -> None:
        class Handler(JsonHandler):
            def do_GET(self) -> None:          # /kvtier/load
                self.send_json(ready("prefill", BT))

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.close_connection = True
                self.connection.shutdown(2)

        super().__init__(Handler)


class FakeDecode(FakeServer):
    """A decode worker that looks ready but fails: `mode` "503" answers every generation
    503 (not generating); "die" streams one chunk and drops the connection mid-answer;
    "early" starts a stream and dies before its first token; "drop" reads the request and
    drops the connection without answering; "full" starts a stream whose first event is a
    kv_cache_full error (as `kvtier serve` says a full cache once a stream started)."""

    def __init__(self, mode: str) -> None:
        me = self
        self.posts = 0
        self.alive = True                      # False: polls get the connection closed, no answer

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:          # /kvtier/load
                if not me.alive:
                    self.close_connection = True
                    return
                self.send_json(ready("decode", BT))

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/tokenize":
                    self.send_response(404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                me.posts += 1
                if mode == "503":
                    self.send_json({"error": {"message": "draining", "code": "service_unavailable"}}, 503)
                    return
                self.close_connection = True
                if mode == "drop":
                    self.connection.shutdown(2)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                if mode == "early":
                    self.wfile.flush()
                    self.connection.shutdown(2)
                    return
                if mode == "full":
                    error = {"error": {"message": "full", "type": "server_error", "param": None, "code": "kv_cache_full"}}
                    for chunk in (b"data: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n", b""):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    return
                chunk = b'data: {"id": "cmpl-fake", "choices": [{"index": 0, "text": "half"}]}\n\n'
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)    # dies before the last chunk

        super().__init__(Handler)


@pytest.fixture
def fake():
    f = FakePrefill()
    yield f
    f.stop()


def test_prefill_worker_dying_mid_request_is_retried_on_another(pd, fake):
    _, p, d, ref, _ = pd
    r = Router("--prefill", fake.url, p.url, "--decode", d.url)       # the dead one first: ties go to it
    try:
        r.wait_ready()
        prompt = "[Turn 3 (retried)] " + PROMPT
        want = _complete(ref.client(), prompt).choices[0].text
        text, lines, usage = _sse(r.url, _body(prompt))
        assert text == want and lines.count("[DONE]") == 1
        assert usage["prompt_tokens_details"]["kvtier_cached_by_tier"]["remote"] == _full_blocks(usage["prompt_tokens"])
        h = r.health().json()
        assert h["stats"]["prefill_retries"] == 1 and h["stats"]["disaggregated"] == 1
        assert [w["failures"] for w in h["workers"] if w["url"] == fake.url] == [1]
    finally:
        r.stop()


def test_with_no_prefill_worker_left_the_decode_worker_computes(pd, fake):
    _, _, d, ref, _ = pd
    r = Router("--prefill", fake.url, "--decode", d.url)
    try:
        r.wait_ready()
        prompt = "[Turn 4 (no prefill left)] " + PROMPT
        want = _complete(ref.client(), prompt).choices[0].text
        got = _complete(r.client(), prompt)
        assert got.choices[0].text == want
        assert got.usage.prompt_tokens_details.model_extra["kvtier_cached_by_tier"]["remote"] == 0
        h = r.health().json()["stats"]
        assert h["prefill_retries"] == 1 and h["direct"] == 1 and h["unserved"] == 0
    finally:
        r.stop()


def test_decode_worker_that_cannot_fetch_recomputes(pd):
    _, p, d, ref, _ = pd
    prompt = "[Turn 5 (prefill gone)] " + PROMPT
    hand = httpx.post(p.url + "/kvtier/prefill", json={"api": "completions", "request": _body(prompt)},
                      timeout=120).json()
    assert hand["keys"] and hand["node"]
    dead = f"127.0.0.1:{_free_port()}"                 # the prefill worker's node is gone
    got = httpx.post(d.url + "/v1/completions", json={**_body(prompt), "kvtier_handoff": _hand(dead, hand["keys"])},
                     timeout=120).json()
    want = _complete(ref.client(), prompt).choices[0].text
    assert got["choices"][0]["text"] == want
    assert got["usage"]["prompt_tokens_details"]["kvtier_cached_by_tier"]["remote"] == 0
    # keys of other weights are ignored, not trusted
    other = httpx.post(d.url + "/v1/completions", json={**_body(prompt + "!"), "kvtier_handoff": _hand(
        hand["node"], ["00" * 16] * len(hand["keys"]))}, timeout=120).json()
    assert other["usage"]["prompt_tokens_details"]["kvtier_cached_by_tier"]["remote"] == 0


def test_workers_act_only_on_what_the_cluster_signed(pd):
    """A hand-over or push target someone made up (no secret) is a 400, before anything is dialled;
    the prefill worker's own signed answer is what the decode worker takes."""
    _, p, d, _, _ = pd
    prompt = "[Turn 9 (signed)] " + PROMPT
    hand = _wrapped(p, "/kvtier/prefill", _body(prompt))
    assert hand["signature"] == _hand(hand["node"], hand["keys"])["signature"]
    evil = {"node": f"127.0.0.1:{_free_port()}", "keys": hand["keys"]}
    for forged in (evil, {**evil, "signature": hand["signature"]}):
        r = httpx.post(d.url + "/v1/completions", json={**_body(prompt), "kvtier_handoff": forged}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kvtier_handoff", r.text
    signed = {k: hand[k] for k in ("node", "keys", "signature")}
    assert _remote_tokens(d, {**_body(prompt), "kvtier_handoff": signed}) == len(hand["keys"]) * BT
    load = _load(d)
    for push_to in (load["node"], {"node": evil["node"], "signature": load["node_signature"]}):
        r = httpx.post(p.url + "/kvtier/prefill", json={"api": "completions", "request": _body(prompt),
                                                        "push_to": push_to}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "push_to", r.text


def test_a_decode_worker_answering_503_or_gone_before_generating_is_replaced_by_the_next(pd):
    _, _, d, ref, _ = pd
    busy, gone = FakeDecode("503"), FakeDecode("503")
    # the failing workers first (ties go to them); one poll only, so `gone` stays in rotation
    r = Router("--decode", busy.url, gone.url, d.url, "--poll-interval", "60")
    try:
        r.wait_ready()
        gone.stop()                                         # unreachable now: connection refused
        prompt = "[Turn 8 (next decode worker)] " + PROMPT
        want = _complete(ref.client(), prompt).choices[0].text
        assert _complete(r.client(), prompt).choices[0].text == want
        h = r.health().json()
        assert h["stats"]["decode_retries"] == 2 and h["stats"]["unserved"] == 0 and busy.posts == 1
        assert {w["url"]: w["sent"] for w in h["workers"]} == {busy.url: 0, gone.url: 0, d.url: 1}
    finally:
        r.stop()
        busy.stop()


def test_a_decode_worker_dying_mid_stream_ends_it_with_an_error_and_is_never_retried(pd):
    _, _, d, _, _ = pd
    dying = FakeDecode("die")
    r = Router("--decode", dying.url, d.url)
    try:
        r.wait_ready()
        lines = []
        body = {**_body("[Turn 9 (mid-stream)] " + PROMPT), "stream": True}
        with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = [x[6:] for x in resp.iter_lines() if x.startswith("data: ")]
        assert json.loads(lines[0])["choices"][0]["text"] == "half"
        assert json.loads(lines[1])["error"]["code"] == "bad_gateway" and lines[2:] == ["[DONE]"]
        h = r.health().json()
        assert dying.posts == 1 and h["stats"]["decode_retries"] == 0
        assert [w["sent"] for w in h["workers"] if w["url"] == d.url] == [0]      # answered once, by nobody else
        # counted and logged: the worker left the rotation (until a poll finds it ready)
        assert h["stats"]["cut"] == 1
        assert [w["failures"] for w in h["workers"] if w["url"] == dying.url] == [1]
        assert any(f"worker {dying.url} (decode): ready -> down (went away mid-answer" in x for x in r.lines), r.lines
        assert "kvtier_router:streams_cut_total 1.0" in httpx.get(r.url + "/metrics", timeout=10).text
    finally:
        r.stop()
        dying.stop()


def _answers_as_one_server(r: Router, ref, prompt: str, stream: bool) -> None:
    """The router answers `prompt` (streamed or not) with what one server gives, once."""
    want = _complete(ref.client(), prompt).choices[0].text
    if stream:
        text, lines, _ = _sse(r.url, _body(prompt))
        assert text == want and lines.count("[DONE]") == 1
    else:
        assert _complete(r.client(), prompt).choices[0].text == want


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_worker_gone_or_full_before_its_first_token_is_replaced_by_the_next(pd, stream):
    """A decode worker killed while it computes the prompt (the stream started, no token yet;
    or no answer at all), or whose stream says its cache is full before any token: the client
    has seen nothing of it, so the next decode worker answers, once, and nothing is cut."""
    _, _, d, ref, _ = pd
    fakes = [FakeDecode(mode) for mode in ("early", "drop", "full")]
    r = Router("--decode", *(f.url for f in fakes), d.url, "--poll-interval", "60")     # the failing ones first
    try:
        r.wait_ready()
        prompt = f"[{stream}: Turn 10 (gone before its first token)] " + PROMPT
        _answers_as_one_server(r, ref, prompt, stream)
        h = r.health().json()
        assert [f.posts for f in fakes] == [1, 1, 1]
        assert h["stats"]["decode_retries"] == 3 and h["stats"]["cut"] == 0 and h["stats"]["unserved"] == 0
        assert {w["url"]: w["sent"] for w in h["workers"]} == {**{f.url: 0 for f in fakes}, d.url: 1}
    finally:
        r.stop()
        for f in fakes:
            f.stop()


class OtherSecretPrefill(FakeServer):
    """A prefill worker started with another --secret-file: its hand-overs carry a signature
    the decode workers refuse. `cluster`: the secret's id it reports (None: it reports none,
    as a worker of an older version)."""

    def __init__(self, cluster: str | None) -> None:
        me = self
        self.prefills = 0

        class Handler(JsonHandler):
            def do_GET(self) -> None:          # /kvtier/load
                self.send_json(ready("prefill", BT, **({"cluster": cluster} if cluster else {})))

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/kvtier/prefill":
                    self.send_json({"error": {"message": "no", "code": "not_found"}}, 404)
                    return
                me.prefills += 1
                self.send_json({"object": "kvtier.prefill", "prompt_tokens": 400, "block_tokens": BT,
                                "keys": ["00" * 16], "node": "127.0.0.1:1", "signature": "ab" * 32})

        super().__init__(Handler)


@pytest.mark.parametrize("tells", [True, False])
def test_a_prefill_worker_with_another_secret_costs_the_client_nothing(pd, tells):
    """Its hand-overs would be refused by the decode worker (400 invalid_signature, a field the
    client never sent). A worker that reports its secret's id is kept out of rotation (and
    /health says why); one that does not is found out by the refusal, and the decode worker is
    asked again without the hand-over. Either way the client gets its answer."""
    _, p, d, ref, _ = pd
    assert _load(p)["cluster"] == _load(d)["cluster"]                   # same --secret-file, same id
    other = OtherSecretPrefill("0123456789abcdef" if tells else None)
    r = Router("--prefill", other.url, "--decode", d.url, "--direct-below", "0")
    try:
        _until(lambda: r.health().json()["calibrated"], r.health().text)
        time.sleep(0.5)                                                  # a few polls
        h = r.health().json()
        mine = next(w for w in h["workers"] if w["url"] == other.url)
        if tells:
            assert mine["status"] == "down" and "secret" in mine["error"], mine
            assert any("differs from every decode worker's" in x for x in r.lines), r.lines
        prompt = f"[{tells}: Turn 11 (another secret)] " + PROMPT
        want = _complete(ref.client(), prompt).choices[0].text
        got = _complete(r.client(), prompt)
        assert got.choices[0].text == want
        h = r.health().json()["stats"]
        if tells:
            assert other.prefills == 0 and h["direct"] == 1
        else:
            assert other.prefills == 1 and h["decode_retries"] == 1
            assert any("refuses the hand-over" in x for x in r.lines), r.lines
        assert "Traceback" not in "".join(r.lines)
    finally:
        r.stop()
        other.stop()


class HangingWorker(FakeServer):
    """A worker that looks ready as `role` and never answers a generation or a prefill: it
    reads the request and waits until the router closes the connection (`closed` lists the
    paths whose call the router gave up). /tokenize answers, so the router calibrates. With
    `freeze`, a request also freezes its polls (a process stopped: SIGSTOP, a deadlock)."""

    def __init__(self, role: str, freeze: bool = False) -> None:
        me = self
        self.posts: list[str] = []
        self.bodies: list[dict] = []
        self.closed: list[str] = []
        self.frozen = threading.Event()
        self.released = threading.Event()

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:          # /kvtier/load
                if me.frozen.is_set():
                    me.released.wait(60)
                    self.close_connection = True
                    return
                self.send_json(ready(role, BT))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/tokenize":
                    self.send_json({"count": 40})
                    return
                me.posts.append(self.path)
                me.bodies.append(json.loads(raw))
                if freeze:
                    me.frozen.set()
                self.connection.settimeout(120)
                try:
                    gone = self.connection.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    me.closed.append(self.path)
                self.close_connection = True

        super().__init__(Handler)

    def stop(self) -> None:
        self.released.set()
        super().stop()


def _until(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_prefill_worker_that_hangs_is_given_up_once_it_stops_answering_polls(pd):
    """A prefill worker that takes the request and then hangs (its polls unanswered too, as a
    SIGSTOPped process) held the client until --request-timeout (600 s); once it has left
    two polls unanswered the router gives its call up and the decode worker computes."""
    _, _, d, ref, _ = pd
    pre = HangingWorker("prefill", freeze=True)
    r = Router("--prefill", pre.url, "--decode", d.url, "--poll-interval", "0.2")
    try:
        r.wait_ready()
        prompt = "[Turn 9 (hung prefill)] " + PROMPT
        want = _complete(ref.client(), prompt).choices[0].text
        got = _complete(r.client(), prompt)
        assert got.choices[0].text == want and pre.posts == ["/kvtier/prefill"]
        _until(lambda: pre.closed == ["/kvtier/prefill"], f"the hung prefill call was not closed: {pre.closed}")
        h = r.health().json()["stats"]
        assert h["prefill_retries"] == 1 and h["direct"] == 1 and h["unserved"] == 0
        assert "Traceback" not in "".join(r.lines)
    finally:
        r.stop()
        pre.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_worker_that_hangs_before_answering_is_replaced_once_it_stops_answering_polls(pd, stream):
    _, _, d, ref, _ = pd
    dec = HangingWorker("decode", freeze=True)
    r = Router("--decode", dec.url, d.url, "--poll-interval", "0.2")      # ties go to the first
    try:
        r.wait_ready()
        prompt = ("[Streamed, hung decode] " if stream else "[Whole, hung decode] ") + PROMPT   # no block in common
        _answers_as_one_server(r, ref, prompt, stream)
        assert dec.posts == ["/v1/completions"]
        _until(lambda: dec.closed == ["/v1/completions"], f"the hung call was not closed: {dec.closed}")
        h = r.health().json()["stats"]
        assert h["decode_retries"] == 1 and h["unserved"] == 0
    finally:
        r.stop()
        dec.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_prefill_or_decode_cancels_the_workers_call(stream):
    """A client that disconnects while the router waits on a prefill worker, or on a decode
    worker's non-streamed answer, closes the router's call to it (so a real worker aborts the
    request) and the router stops counting that load."""
    pre, dec = HangingWorker("prefill"), HangingWorker("decode")
    r = Router("--prefill", pre.url, "--decode", dec.url, "--direct-below", "0")
    try:
        _until(lambda: r.health().json()["calibrated"] and r.health().json()["status"] == "ready", r.health().text)
        body = {**_body("[gone during prefill] " + PROMPT), "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/completions", json=body, timeout=2)
        _until(lambda: pre.closed == ["/kvtier/prefill"], f"the prefill call was not cancelled: {pre.closed}")
        assert dec.posts == []
        r2 = Router("--decode", dec.url)
        try:
            _until(lambda: r2.health().json()["status"] == "ready", r2.health().text)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(r2.url + "/v1/completions", json={**_body("[gone during decode]"), "stream": stream},
                           timeout=2)
            _until(lambda: dec.closed == ["/v1/completions"], f"the decode call was not cancelled: {dec.closed}")
            _until(lambda: [w["decode_seqs"] for w in r2.health().json()["workers"]] == [0], r2.health().text)
            assert 'kvtier_router:requests_total{outcome="abandoned",route="completions"} 1.0' in \
                httpx.get(r2.url + "/metrics", timeout=10).text
        finally:
            r2.stop()
        assert [w["prefill_tokens"] for w in r.health().json()["workers"]] == [0, 0]
        assert "Traceback" not in "".join(r.lines + r2.lines)
    finally:
        r.stop()
        pre.stop()
        dec.stop()


def test_the_router_never_passes_a_clients_handoff_on():
    """`kvtier_handoff` is the router's to set: a client's would make a decode worker dial any
    host:port."""
    dec = HangingWorker("decode")
    r = Router("--decode", dec.url)
    try:
        _until(lambda: r.health().json()["status"] == "ready", r.health().text)
        evil = {**_body("hi"), "kvtier_handoff": {"node": "10.0.0.1:22", "keys": ["00" * 16]}}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/completions", json=evil, timeout=1)
        _until(lambda: dec.bodies, "the decode worker got nothing")
        assert dec.bodies[0]["prompt"] == "hi" and "kvtier_handoff" not in dec.bodies[0]
    finally:
        r.stop()
        dec.stop()


def test_a_router_stopped_mid_stream_cuts_it_quietly_and_exits_zero():
    """SIGTERM while an answer streams: after --shutdown-timeout the stream is cut (the client
    sees a broken stream), the router exits 0, and its log says so in one line, no traceback."""
    class Endless(JsonHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_json(ready("decode", BT))

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            chunk = b'data: {"id": "cmpl-endless", "choices": [{"index": 0, "text": "x"}]}\n\n'
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                self.close_connection = True

    dec = FakeServer(Endless)
    r = Router("--decode", dec.url, "--shutdown-timeout", "0.5")
    try:
        _until(lambda: r.health().json()["status"] == "ready", r.health().text)
        lines: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", r.url + "/v1/completions", json={**_body("hi"), "stream": True}, timeout=30) as s:
                for line in s.iter_lines():
                    lines.append(line)
                    if len(lines) == 1:
                        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(30) == 0 and lines and "data: [DONE]" not in lines
        time.sleep(0.2)                        # the log reader thread catches up
        log = "".join(r.lines)
        assert "Traceback" not in log and "ERROR" not in log and "CancelledError" not in log, log
        assert "kvtier router: cutting 1 answer(s) still running after --shutdown-timeout" in log, log
    finally:
        r.stop()
        dec.stop()


def test_health_says_down_once_every_decode_worker_that_was_ready_is_gone():
    """'starting' while a decode worker has never been ready (it may be coming up), 'down'
    once each was ready and none is now; 503 either way."""
    fake = FakeDecode("die")
    r = Router("--decode", fake.url)
    try:
        deadline = time.monotonic() + 30
        while r.health().json()["status"] != "ready":
            assert time.monotonic() < deadline, r.health().text
            time.sleep(0.1)
        fake.alive = False
        while (h := r.health()).json()["status"] != "down":
            assert time.monotonic() < deadline + 30, h.text
            assert h.json()["status"] == "ready", h.text      # never "starting" again
            time.sleep(0.1)
        assert h.status_code == 503
    finally:
        r.stop()
        fake.stop()


def test_router_disconnects_silent_clients_and_logs_no_traceback_for_one_gone_mid_body():
    """The router shares the server's HTTP settings: --read-timeout closes a connection that
    sends nothing, and a client gone half-way through its body is not an internal error."""
    fake = FakeDecode("die")
    r = Router("--decode", fake.url, "--read-timeout", "1")
    try:
        host, port = r.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as idle:
            assert idle.recv(10) == b""          # closed by the router (a hang: the socket's 10 s timeout)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        assert r.health().status_code in (200, 503)            # still up
        log = "".join(r.lines)
        assert "Traceback" not in log and "internal error" not in log, log
    finally:
        r.stop()
        fake.stop()


def _finished(server) -> dict[str, float]:
    """The server's finished requests by reason (length, stop, abort, error)."""
    counts = server.metrics().get("kvtier:request_success_total", {})
    return {dict(k)["finished_reason"]: v for k, v in counts.items()}


def test_a_prefill_worker_counts_its_prefills_in_its_metrics(pd):
    """/kvtier/prefill requests are requests of the prefill worker: kvtier:request_success_total
    counts them (each a one-token `length`; one the router gave up, `abort`), and every finish reason's
    series is there from the start, so a rate over them works on a fresh worker."""
    _, p, *_ = pd
    before = _finished(p)
    assert set(before) == {"length", "stop", "abort", "error"}, before
    _wrapped(p, "/kvtier/prefill", _body("[prefill counted] " + PROMPT))
    after = _finished(p)
    assert after["length"] == before["length"] + 1 and after["abort"] == before["abort"], after


def test_a_router_restart_loses_only_what_was_in_flight(pd):
    """Router A answers a session's first turn, then is stopped (SIGTERM) while it streams a
    long answer: that client's stream breaks, the decode worker stops generating it, and
    nobody answers it again. Router B, started on the same port over the same workers, answers
    new requests and learns from the workers' KV events what they hold: the session's next
    turn goes straight to the decode worker holding its history, from its own tiers."""
    _, p, d, ref, _ = pd
    before = _finished(d)
    a = Router("--prefill", p.url, "--decode", d.url, "--shutdown-timeout", "0.5")
    port = int(a.url.rsplit(":", 1)[1])
    b = None
    try:
        a.wait_ready()
        turn1 = "[Turn 10 (before the restart)] " + PROMPT
        first = _complete(a.client(), turn1)
        assert a.health().json()["stats"]["disaggregated"] == 1
        # a long answer in flight when A is stopped: its stream ends early, without [DONE]
        lines: list[str] = []
        cut = None
        try:
            with httpx.stream("POST", a.url + "/v1/completions", timeout=60,
                              json={**_body("[Turn 11 (in flight)]", 1500), "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:
                            a.proc.send_signal(signal.SIGTERM)
        except httpx.HTTPError as e:
            cut = e                                # the connection dropped: a truncated stream
        assert a.proc.wait(30) == 0                # a clean stop, after --shutdown-timeout
        assert isinstance(cut, httpx.RemoteProtocolError), cut
        assert lines and "[DONE]" not in lines and len({json.loads(x)["id"] for x in lines}) == 1
        deadline = time.monotonic() + 30           # the decode worker aborts it: nothing left running
        while _finished(d).get("abort", 0) == before.get("abort", 0) or _load(d)["running"]:
            assert time.monotonic() < deadline, _load(d)
            time.sleep(0.2)
        b = Router("--prefill", p.url, "--decode", d.url, port=port)
        assert b.url == a.url
        b.wait_ready()
        # B learns from the decode worker's events that it holds turn 1 (pulled through A) ...
        held = len(_wrapped(d, "/kvtier/keys", _body(turn1))["keys"])
        deadline = time.monotonic() + 30
        while [w.get("kv_events", {}).get("blocks", 0) for w in b.health().json()["workers"]
               if w["url"] == d.url] < [held]:
            assert time.monotonic() < deadline, b.health().text
            time.sleep(0.2)
        # ... so turn 2 goes straight to it (a router that knew nothing would prefill it elsewhere)
        turn2 = turn1 + first.choices[0].text + " Turn 2: run the tests."
        want = _complete(ref.client(), turn2)
        got = _complete(b.client(), turn2)
        assert got.choices[0].text == want.choices[0].text and got.usage.prompt_tokens >= 256 + BT
        stats = b.health().json()["stats"]
        assert (stats["requests"], stats["direct"], stats["disaggregated"]) == (1, 1, 0)
        details = got.usage.prompt_tokens_details
        assert details.cached_tokens >= _full_blocks(first.usage.prompt_tokens)
        assert details.model_extra["kvtier_cached_by_tier"]["remote"] == 0
        # every request answered once: turns 1 and 2 finished, the one in flight aborted
        after = _finished(d)
        assert after.get("length", 0) - before.get("length", 0) == 2
        assert after.get("abort", 0) - before.get("abort", 0) == 1
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_non_streamed_answer_whose_client_left_is_aborted_on_the_decode_worker(pd):
    """Through the router as on one server: the decode worker stops generating for a client
    that went away before its (non-streamed) answer was complete."""
    router, _, d, _, _ = pd
    before = _finished(d)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=_body("[Turn 12 (gone, not streamed)]", 1500), timeout=1.5)
    deadline = time.monotonic() + 30
    while _finished(d).get("abort", 0) == before.get("abort", 0) or _load(d)["running"]:
        assert time.monotonic() < deadline, (_finished(d), _load(d))
        time.sleep(0.2)
    assert _finished(d).get("length", 0) == before.get("length", 0)      # not generated to the end
    assert [w["decode_seqs"] for w in router.health().json()["workers"] if w["url"] == d.url] == [0]


def test_router_metrics(pd, pd_push):
    """The router's counters move by exactly the requests this test sends (it depends on no
    other test's traffic), and its hand-over byte counts match the workers' own."""
    from prometheus_client.parser import text_string_to_metric_families

    router, p, d, _, _ = pd

    def scrape(r) -> dict:
        text = httpx.get(r.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    req = "kvtier_router:requests_total"

    def count(m: dict, outcome: str, route: str) -> float:
        return m.get((req, (("outcome", outcome), ("route", route))), 0.0)

    before = scrape(router)
    _complete(router.client(), "[metrics] " + PROMPT)                        # disaggregated
    _complete(router.client(), "Hi", 4)                                       # direct: a short prompt
    bad = httpx.post(router.url + "/v1/completions", json={**_body(PROMPT), "temperature": 7}, timeout=60)
    assert bad.status_code == 400                                             # rejected
    msgs = [{"role": "system", "content": "[metrics] " + PROMPT}, {"role": "user", "content": "Go."}]
    router.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    _complete(pd_push.client(), "[metrics, pushed] " + PROMPT)
    m = scrape(router)
    for outcome, route in [("disaggregated", "completions"), ("direct", "completions"),
                           ("rejected", "completions"), ("disaggregated", "chat")]:
        assert count(m, outcome, route) - count(before, outcome, route) == 1, (outcome, route)
    assert m[("kvtier_router:worker_up", (("pool", "decode"), ("worker", d.url)))] == 1
    assert m[("kvtier_router:worker_prefill_tokens", (("pool", "prefill"), ("worker", p.url)))] == 0
    assert m[("kvtier_router:worker_decode_requests", (("pool", "decode"), ("worker", d.url)))] == 0
    # The hand-over bytes are what each worker reported at the router's last poll (every 0.5 s):
    # they catch up with the worker's own count within a poll or two.
    for r, w, way in ((router, d, "pulled"), (pd_push, p, "pushed")):
        deadline = time.monotonic() + 5
        while True:
            seen = scrape(r)[("kvtier_router:handoff_bytes_total", (("direction", way), ("worker", w.url)))]
            own = _load(w)[f"{way}_bytes"]
            if seen == own or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert seen == own > 0, way


def test_no_worker_ready_is_one_5xx_json_error():
    r = Router("--decode", f"http://127.0.0.1:{_free_port()}", "--max-body-size", "1KiB")
    try:
        resp = httpx.post(r.url + "/v1/completions", json=_body("hello"), timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "service_unavailable"
        big = httpx.post(r.url + "/v1/completions", json=_body("x" * 4096), timeout=30)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert r.health().status_code == 503
    finally:
        r.stop()


# -- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (["router"], "--decode"),
    (["router", "--decode", "localhost:8000"], "localhost:8000"),
    (["router", "--decode", "http://127.0.0.1:8001", "--prefill", "http://127.0.0.1:8001"], "twice"),
    (["router", "--decode", "http://127.0.0.1:8001", "--policy", "magic"], "--policy"),
    (["serve", "--role", "middle"], "--role"),
    (["serve", "--role", "prefill", "--node-listen", "nonsense"], "nonsense"),
])
def test_cli_bad_input_is_one_line(args, needle):
    r = run_kvtier(*args, timeout=120)
    assert_one_line_error(r, 2, needle)


def test_busy_node_port_is_one_line():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = s.getsockname()[1]
        r = run_kvtier("serve", "--role", "prefill", "--port", "0", "--node-listen", f"127.0.0.1:{busy}", timeout=120)
    assert_one_line_error(r, 2, "node")


def test_bench_disagg_answers_every_request_through_the_router():
    r = run_kvtier("bench", "disagg", "--setups", "pd", "--handoff", "push", "--direct-below", "0", "--sessions", "2",
                   "--max-requests", "3", "--max-tokens", "4", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (row["setup"], row["completed"], row["lost"], row["duplicates"], row["server_exit"]) == ("pd", 3, 0, 0, 0)
    assert row["handoff"] == "push" and row["disaggregated"] == 3 and row["moved_bytes"] > 0


def test_bench_disagg_table_fits_a_pipe(monkeypatch, capsys):
    """Its 16 columns were 131 characters wide: every cell wrapped at a pipe's 100."""
    from kvtier.bench import common
    from kvtier.bench.disagg import columns
    monkeypatch.setenv("KVTIER_STRICT_TABLES", "1")
    monkeypatch.setenv("COLUMNS", "100")
    row = dict(setup="pd", handoff="push", completed=300, lost=0, duplicates=0, out_tok_per_s=1234.5, ttft_p50_ms=36.3,
               ttft_p90_ms=162.7, ttft_p99_ms=11170.2, itl_p50_ms=1.1, itl_p90_ms=30.4, itl_p99_ms=101.9,
               hit_ratio=0.964, moved_bytes=123_456_789_012, move_gb_per_s=12.349)
    common.emit([row, dict(row, setup="colocated", handoff=None)], False,
                "router + workers on loopback, 40 streaming clients, 128 tokens each (times in ms)", columns(), left=1)
    out = capsys.readouterr().out
    assert "pd-push" in out and "300/0/0" in out and "36/163/11170" in out and "1.1/30/102" in out, out
