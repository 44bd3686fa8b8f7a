"""`kvtier serve` end to end: servers in subprocesses on loopback, the official openai client,
raw HTTP for the bad cases, /metrics parsed, a client disconnect, SIGTERM draining, and two
servers sharing blocks (cluster mode). Two servers are started for the whole file (A, and B
that fetches from A's blocks); every process a test starts is stopped by it."""
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
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from conftest import assert_one_line_error, child_env, run_kvtier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "kimi-tiny"
PROMPT = "The agent's shared system prompt: you can call tools, read files and answer. Turn 1."
STARTUP_S = 120
JSON_TYPE = {"content-type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `kvtier serve` subprocess; `url` once it printed that it is ready."""

    def __init__(self, *args: str) -> None:
        env = child_env(OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--model", MODEL,
             "--kv-cache", "4MiB", "--host-cache", "8MiB", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        self.lines: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("kvtier serve: ready:"):
                self.url = line.split(" on ", 1)[1].split()[0]
                self._ready.set()
        self._ready.set()

    def wait_ready(self) -> Server:
        assert self._ready.wait(STARTUP_S), self.lines
        assert self.url, self.lines
        return self

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, dict[tuple, float]]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[str, dict[tuple, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out.setdefault(s.name, {})[key] = s.value
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Server A serves its blocks to peers; server B fetches from A."""
    secret = tmp_path_factory.mktemp("serve") / "secret"
    secret.write_text("0123456789abcdef-test-secret")
    kv_port = _free_port()
    a = Server("--kv-listen", f"127.0.0.1:{kv_port}", "--secret-file", str(secret), "--max-body-size", "64KiB")
    b = Server("--peers", f"127.0.0.1:{kv_port}", "--secret-file", str(secret), "--kv-cache", "8MiB")
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def server(cluster):
    return cluster[0]


@pytest.fixture(scope="module")
def reference():
    """What LLM.generate gives, greedy, for PROMPT (the same weights as the servers')."""
    from kvtier import StoreConfig
    from kvtier.engine import LLM, SamplingParams
    with LLM(MODEL, cache=StoreConfig(device_capacity="4MiB", host_capacity=None)) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    return out


# -- the API, through the official client --------------------------------------------------


def test_completion_equals_llm_generate_streamed_and_not(server, reference):
    c = server.client()
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == reference.token_ids
    assert whole.choices[0].text == reference.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert whole.usage.completion_tokens == 24
    pieces, usage, finish = [], None, None
    for chunk in c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 24
    # the second and third requests found the prompt's full blocks cached
    details = usage.prompt_tokens_details
    assert details.cached_tokens == (len(reference.prompt_token_ids) - 1) // 16 * 16 > 0
    assert details.model_extra["kvtier_cached_by_tier"]["device"] == details.cached_tokens


def test_chat_streamed_equals_not_streamed(server):
    c = server.client()
    messages = [{"role": "system", "content": "You are an agent with tools."},
                {"role": "user", "content": "List the files, then read the first one."}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    roles, pieces = [], []
    for chunk in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            roles.append(ch.delta.role)
            pieces.append(ch.delta.content or "")
    assert roles[0] == "assistant"
    assert "".join(pieces) == whole.choices[0].message.content
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_created_is_the_requests_time(server):
    """`created` is when the request arrived (OpenAI's meaning), not when the server started."""
    c = server.client()
    time.sleep(1.1)                      # the server started at least this long before
    t0 = int(time.time())
    whole = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    chunks = list(c.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True))
    assert t0 <= whole.created <= time.time()
    assert chunks and all(t0 <= ch.created <= time.time() for ch in chunks)


def test_too_long_blames_the_field_the_client_sent_and_no_max_tokens_fits_the_cache(server):
    """A prompt too long for the context names the prompt (or messages), not max_tokens the
    client never sent; a max_tokens too large names max_tokens; a chat without max_tokens on a
    server whose KV cache holds fewer tokens than the context generates up to what fits."""
    def error(body: dict) -> dict:
        r = httpx.post(server.url + ("/v1/chat/completions" if "messages" in body else "/v1/completions"),
                       json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error({"messages": [{"role": "user", "content": "x" * 9000}]})["param"] == "messages"
    assert error({"prompt": "x" * 9000})["param"] == "prompt"
    assert error({"prompt": "x" * 9000, "max_tokens": 4})["param"] == "prompt"
    assert error({"prompt": "hi", "max_tokens": 9000})["param"] == "max_tokens"
    assert error({"prompt": "hi", "max_tokens": 1700})["param"] == "max_tokens"   # fits the context, not the cache
    assert error({"prompt": "x" * 2000, "max_tokens": 4})["param"] == "prompt"     # the prompt alone is too long
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text     # the 4 MiB KV cache holds 1,632 of the context's 8,192 tokens
    assert r.json()["usage"]["total_tokens"] <= 1632


def test_session_affinity_pins_and_is_echoed(server):
    c = server.client()
    before = sum(server.metrics()["kvtier:store_pinned_bytes"].values())
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="session seven: " + PROMPT, max_tokens=2,
                                                 extra_headers={"x-session-affinity": "agent-7"})
    assert raw.headers["x-session-affinity"] == "agent-7"
    assert raw.parse().usage.prompt_tokens > 16
    with c.completions.with_streaming_response.create(model=MODEL, prompt="session eight: " + PROMPT, max_tokens=2,
                                                      stream=True,
                                                      extra_headers={"x-session-affinity": "agent-8"}) as resp:
        assert resp.headers["x-session-affinity"] == "agent-8"
        assert b"data: [DONE]" in resp.read()
    m = server.metrics()
    assert sum(m["kvtier:store_pinned_bytes"].values()) > before
    assert m["kvtier:store_pinned_sessions"][()] >= 2
    bad = httpx.post(server.url + "/v1/completions", content=b"{",
                     headers={"x-session-affinity": "agent-9", "content-type": "application/json"})
    assert bad.status_code == 400 and bad.headers["x-session-affinity"] == "agent-9"


# -- bad requests, raw HTTP ---------------------------------------------------------------


@pytest.mark.parametrize("method,path,body,status,code", [
    ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("POST", "/v1/completions", b'{"model": "x", "prompt": ' + b"[" * 300 + b"]" * 300 + b"}", 400, "invalid_json"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 9000, "max_tokens": 4}, 400, "context_length_exceeded"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "context_length_exceeded"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "unsupported"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "invalid_value"),
    ("POST", "/v1/completions", [1, 2], 400, "invalid_value"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
    ("GET", "/v1/completions", None, 405, "method_not_allowed"),
    ("GET", "/v2/nothing", None, 404, "not_found"),
    ("GET", "/kvtier/events?limit=0", None, 400, "invalid_value"),
    ("GET", "/kvtier/events?limit=-5", None, 400, "invalid_value"),
    ("GET", "/kvtier/events?since=-1", None, 400, "invalid_value"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 70_000}, 413, "request_too_large"),
])
def test_bad_requests_get_openai_error_bodies(server, method, path, body, status, code):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    r = httpx.request(method, server.url + path, content=content, timeout=30, headers=JSON_TYPE)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]
    assert "Traceback" not in r.text


def test_tokenize_detokenize_health(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "héllo"}).json()
    assert r["tokens"] == [256, *"héllo".encode()] and r["count"] == 7
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [-1]}).status_code == 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_parse_and_name_like_vllm(server):
    c = server.client()
    for _ in range(2):                       # the second request finds the first's blocks on the device
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    m = server.metrics()
    for name in ("kvtier:time_to_first_token_seconds_count", "kvtier:inter_token_latency_seconds_count",
                 "kvtier:e2e_request_latency_seconds_count", "kvtier:num_requests_running",
                 "kvtier:num_requests_waiting", "kvtier:prefix_cache_queries_total", "kvtier:kv_cache_usage_perc",
                 "kvtier:store_used_bytes", "kvtier:store_evictions_total", "kvtier:store_pinned_bytes",
                 "kvtier:store_verification_failures_total", "kvtier:store_pins_shed_total"):
        assert name in m, name
    assert set(m["kvtier:prefix_cache_hits_total"]) == {(("tier", t),) for t in ("device", "host", "disk", "remote")}
    assert m["kvtier:time_to_first_token_seconds_count"][()] >= 1
    assert m["kvtier:prefix_cache_hits_total"][(("tier", "device"),)] > 0


def test_client_disconnect_frees_pages(server):
    def busy(m) -> tuple[float, float]:
        return m["kvtier:num_requests_running"][()], m["kvtier:kv_pages_in_use"][()]

    body = {"model": MODEL, "prompt": "a long answer, please", "max_tokens": 1500, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        running, pages = busy(server.metrics())
        assert running == 1 and pages > 0
    deadline = time.monotonic() + 30
    while busy(server.metrics()) != (0, 0):
        assert time.monotonic() < deadline, "the aborted request still holds pages"
        time.sleep(0.2)
    assert server.metrics()["kvtier:request_success_total"][(("finished_reason", "abort"),)] >= 1


# -- cluster mode and shutdown (server B) ----------------------------------------------------


def test_cluster_fetches_a_prefix_another_server_computed(cluster):
    a, b = cluster
    prompt = "Cluster turn: " + PROMPT
    first = a.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    other = b.client().completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    by_tier = other.usage.prompt_tokens_details.model_extra["kvtier_cached_by_tier"]
    assert by_tier["remote"] > 0 and by_tier["remote"] == other.usage.prompt_tokens_details.cached_tokens
    assert other.choices[0].text == first.choices[0].text


@pytest.fixture
def draining():
    """A server of its own on the CPU, draining in 4 s: on a GPU the 1,500-token answer below
    ends in about a second, before the drain's deadline, and nothing would be cut."""
    b = Server("--device", "cpu", "--shutdown-timeout", "4", "--kv-cache", "8MiB")
    try:
        yield b.wait_ready()
    finally:
        b.stop()


def test_sigterm_drains_then_exits_zero(draining):
    b = draining
    results: dict[str, list[str]] = {"short": [], "long": []}

    def stream(name: str, max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": f"{name} stream", "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", b.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[name].append(line[6:])

    threads = [threading.Thread(target=stream, args=("short", 40)), threading.Thread(target=stream, args=("long", 1500))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not (results["short"] and results["long"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    health = httpx.get(b.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = httpx.post(b.url + "/v1/completions", json={"model": MODEL, "prompt": "late"}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
    for t in threads:
        t.join(60)
    assert b.proc.wait(60) == 0, b.lines
    short, long = results["short"], results["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long[-1] == "[DONE]" and json.loads(long[-2])["error"]["code"] == "shutting_down"
    assert any("stopped" in line for line in b.lines)


def _until(ok, why, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def test_a_second_sigterm_ends_the_answers_in_flight_now():
    """Draining with a long --shutdown-timeout, a second SIGTERM stops waiting (as uvicorn and
    vLLM do): the answer in flight ends with an error chunk and the server exits 0."""
    b = Server("--device", "cpu", "--shutdown-timeout", "3600").wait_ready()
    try:
        seen: list[str] = []

        def stream() -> None:
            body = {"model": MODEL, "prompt": "long stream", "max_tokens": 1500, "stream": True, "temperature": 0,
                    "ignore_eos": True}
            with httpx.stream("POST", b.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        seen.append(line[6:])

        t = threading.Thread(target=stream)
        t.start()
        _until(lambda: seen, b.lines)                             # generating
        b.proc.send_signal(signal.SIGTERM)
        _until(lambda: any("kvtier serve: draining" in line for line in b.lines), b.lines)
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(120) == 0, b.lines
        t.join(60)
        assert seen[-1] == "[DONE]" and json.loads(seen[-2])["error"]["code"] == "shutting_down", seen[-3:]
        assert "second stop signal" in json.loads(seen[-2])["error"]["message"]
        assert any("stopping now" in line for line in b.lines), b.lines
    finally:
        b.stop()


# -- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    (["--port", "99999"], "--port"),
    (["--model", "no-such-preset"], "no-such-preset"),
    (["--kv-cache", "1KiB"], "--kv-cache"),
    (["--secret-file", "/nonexistent/secret"], "cluster mode"),         # read by nothing: said, not ignored
    (["--host", "192.0.2.1"], "give --host one of this machine's addresses"),
    (["--device", "foo"], "--device foo"),                              # found before `listening on`
    (["--kv-cache", "1000TiB"], "memory available"),
    (["--kv-listen", "0.0.0.0:0", "--directory", "redis://127.0.0.1:1", "--secret-file", __file__],
     "give --advertise HOST:PORT"),                                      # before the model loads
])
def test_cli_bad_input_is_one_line(args, needle):
    r = run_kvtier("serve", *args, timeout=120)
    assert_one_line_error(r, 2, needle)


def test_incremental_text_holds_back_partial_utf8():
    from kvtier.engine.tokenizer import ByteTokenizer
    from kvtier.serve.detok import IncrementalText

    tok, text = ByteTokenizer(512), "héllo 中文 ok"
    ids = [*text.encode(), ByteTokenizer.EOS]
    inc = IncrementalText(tok)
    pieces = [inc.push([i]) for i in ids] + [inc.push([], final=True)]
    assert "".join(pieces) == inc.text == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces) and "中" in pieces


def test_bench_serve_replays_sessions_completely():
    r = run_kvtier("bench", "serve", "--modes", "affinity", "--sessions", "2", "--max-requests", "4",
                   "--clients", "2", "--max-tokens", "4", "--kv-cache", "4MiB", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    (row,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert (row["requests"], row["completed"], row["lost"], row["duplicates"], row["server_exit"]) == (4, 4, 0, 0, 0)
    assert row["mode"] == "affinity" and 0 <= row["hit_ratio"] <= 1 and row["ttft_p50_ms"] > 0


def test_bench_serve_says_why_its_requests_failed():
    """Requests past the server's context (its default cache of 6 MiB) were each lost, and
    the run exited 1 with a table of 0/4/0 and no word of why (the reason was in --json only)."""
    r = run_kvtier("bench", "serve", "--modes", "none", "--sessions", "2", "--max-requests", "2",
                   "--clients", "2", "--max-tokens", "3000", timeout=300)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "kvtier bench serve: none: 2 of 2 requests failed" in r.stderr, r.stderr
    assert "maximum context length" in r.stderr


def test_bench_serve_routes_two_servers_by_request_or_through_the_router():
    """The affinity effect needs requests spread over servers with and without affinity:
    --route request sends each request to the next server, router goes through `kvtier
    router`; every request is answered once either way and the rows say how they went."""
    r = run_kvtier("bench", "serve", "--servers", "2", "--no-links", "--route", "request,router", "--modes", "none",
                   "--sessions", "2", "--max-requests", "4", "--clients", "2", "--max-tokens", "4",
                   "--kv-cache", "4MiB", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["route"], x["links"], x["servers"]) for x in rows] == [("request", False, 2), ("router", False, 2)]
    for row in rows:
        assert (row["requests"], row["completed"], row["lost"], row["duplicates"], row["server_exit"]) == (4, 4, 0, 0, 0)
        assert row["cached_remote"] == 0                      # no links: each server has only its own cache


def test_bench_serve_sends_a_session_to_one_server_or_each_request_to_the_next(monkeypatch):
    """What --route session and request mean, at the client: a session's turns all to one
    server, or the servers taken in turn whatever the session."""
    import argparse
    import asyncio

    import kvtier.bench.serve as bench

    sent: list[tuple[str, str]] = []

    async def one(client, model, turn, max_tokens, affinity):
        sent.append((turn.session, str(client.base_url)))
        return bench.Result(turn.session, turn.index, ok=True)
    monkeypatch.setattr(bench, "_one", one)
    sessions = [[bench.Turn(f"s{i}", k, [1, 2, 3]) for k in range(3)] for i in range(4)]
    args = argparse.Namespace(clients=1, active=1, think=0.0, duration=60.0, max_tokens=1)
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    asyncio.run(bench._replay(urls, "m", sessions, args, False))
    assert all(len({u for s, u in sent if s == f"s{i}"}) == 1 for i in range(4))
    assert {u for _, u in sent} == {u + "/v1/" for u in urls}
    sent.clear()
    asyncio.run(bench._replay(urls, "m", sessions, args, False, by_request=True))
    assert [u for _, u in sent] == [u + "/v1/" for u in urls] * 6


def test_connections_past_the_cap_get_503_and_the_server_goes_on():
    srv = Server("--max-connections", "2").wait_ready()       # the asking connection counts too
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        with socket.create_connection((host, int(port)), timeout=30):      # one idle connection fills the cap
            time.sleep(0.5)                                               # (the server accepts it first)
            over = httpx.get(srv.url + "/health", timeout=30)
        assert over.status_code == 503
        for _ in range(50):                                               # served again once it closed
            if httpx.get(srv.url + "/health", timeout=30).status_code == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the server never served again after the idle connection closed")
    finally:
        srv.stop()


def test_silent_clients_are_disconnected_and_answers_are_not_cut():
    """Connections that send nothing (or stop half-way through a body) are closed after
    --read-timeout, so they cannot hold --max-connections; a stalled body gets a 408 JSON
    error; a client gone mid-body leaves no traceback in the log; a long answer to a client
    that sends nothing meanwhile is not cut."""
    srv = Server("--max-connections", "4", "--read-timeout", "1", "--device", "cpu").wait_ready()   # a CPU's pace
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
        time.sleep(0.3)
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
        for s in idle:                                   # closed by the server: EOF
            assert s.recv(10) == b""
            s.close()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200

        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        status, _, body = reply.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), reply
        assert json.loads(body)["error"]["code"] == "request_timeout"

        for _ in range(3):                               # gone mid-body
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(head)
                time.sleep(0.2)

        t0 = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 600, "ignore_eos": True,
                                "stream": True}) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - t0 > 1.5, "the answer must outlast --read-timeout for this test to mean anything"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        log = "\n".join(srv.lines)
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    finally:
        srv.stop()


def test_sigterm_stops_a_server_whose_stdout_reader_went_away():
    """The status lines ("draining", "stopped") cannot be written when whoever started the
    server stopped reading its stdout (a closed pipe): it still drains and exits 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--model", MODEL,
         "--kv-cache", "4MiB", "--host-cache", "8MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env(OMP_NUM_THREADS="1"), cwd=REPO)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + STARTUP_S
        while not proc.stdout.readline().startswith("kvtier serve: ready:"):
            assert time.monotonic() < deadline and proc.poll() is None
        proc.stdout.close()                  # nobody reads its stdout any more
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
