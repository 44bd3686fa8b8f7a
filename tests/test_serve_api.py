"""`kvtier serve`'s request handling without a model: the routes over a stand-in engine that
is ready and answers each request with scripted events (by default: finished at once, nothing
generated), with a byte-level tokenizer, so what a chat template rendered reads back as text."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from kvtier.engine.tokenizer import ByteTokenizer  # noqa: E402
from kvtier.serve import protocol as P  # noqa: E402
from kvtier.serve.app import Service, build_app  # noqa: E402
from kvtier.serve.disagg import Disagg  # noqa: E402
from kvtier.serve.engine_loop import Event, Finished, Submission, Tokens  # noqa: E402
from kvtier.serve.metrics import ServeMetrics  # noqa: E402

MODEL = "kimi-tiny"
CONTEXT = 8192
# Like Llama-2's and Mistral's: roles must alternate; and like agents' templates, it renders
# an assistant's tool calls and a tool result's call id.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) and m['role'] != 'tool' %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
            "<{{ m['role'] }}{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m['content'] }}"
            "{% for tc in m.tool_calls or [] %}<call {{ tc.id }} {{ tc.function.name }} "
            "{{ tc.function.arguments | tojson }}>{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
AGENT = [{"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


BT = 16


def _keys(ids: list[int]) -> list[bytes]:
    """The stand-in's block keys: one per full block, made of the block's tokens."""
    return [bytes(t % 256 for t in ids[i:i + BT]) for i in range(0, len(ids) - len(ids) % BT, BT)]


class Engine:
    """A ready engine that answers a submission with `script(sub)`'s events and records it."""

    def __init__(self, llm: SimpleNamespace) -> None:
        self.llm, self.error = llm, None
        self.ready = threading.Event()
        self.ready.set()
        self.subs: list[Submission] = []
        self.failed: list[str] = []
        self.script = lambda sub: [Finished("length", len(sub.prompt), 0, {})]

    def submit(self, sub: Submission) -> None:
        self.subs.append(sub)
        sub.deliver(list(self.script(sub)))

    def abort(self, _rid: str) -> None:
        pass

    def counts(self) -> tuple[int, int]:
        return 0, 0

    def fail_all(self, message: str) -> None:
        self.failed.append(message)


def _service(tokenizer_dir: Path | None = None, request_pages: int = 10_000, disagg: Disagg | None = None) -> Service:
    tok = ByteTokenizer(512)
    llm = SimpleNamespace(tokenizer=tok, info=SimpleNamespace(tokenizer_path=tokenizer_dir),
                          config=SimpleNamespace(max_position_embeddings=CONTEXT, vocab_size=512),
                          adapter=SimpleNamespace(block_tokens=BT, keys=_keys,
                                                  device_tier=SimpleNamespace(capacity_blocks=request_pages)),
                          request_pages=request_pages, eos=tok.eos_token_id,
                          scheduler=SimpleNamespace(running=[], waiting=[]),
                          store=SimpleNamespace(layout=SimpleNamespace(block_bytes=1024),
                                                stats=lambda: SimpleNamespace(tiers=[])))
    return Service(Engine(llm), ServeMetrics(MODEL), MODEL, disagg=disagg)


def _client(tokenizer_dir: Path | None = None, **kw) -> TestClient:
    return TestClient(build_app(_service(tokenizer_dir, **kw)), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> TestClient:
    d = tmp_path_factory.mktemp("ckpt")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return _client(d)


@pytest.fixture(scope="module")
def plain() -> TestClient:
    return _client(None)


def _error(r, status: int, param: str | None, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and (err["param"], err["code"]) == (param, code), err
    return err


def _rendered(client: TestClient, messages: list) -> str:
    r = client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return ByteTokenizer(512).decode(r.json()["tokens"])


def test_tokenize_refused_by_the_template_is_a_400_as_chat_is(templated):
    msgs = [{"role": "assistant", "content": "I speak first"}]
    tok = _error(templated.post("/tokenize", json={"model": MODEL, "messages": msgs}), 400, "messages", "invalid_value")
    chat = _error(templated.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}),
                  400, "messages", "invalid_value")
    assert tok["message"] == chat["message"] and "roles must alternate" in tok["message"]


def test_tool_calls_reach_the_chat_template(templated):
    want = '<bos><user>weather in Paris?<assistant><call call_1 get_weather {"city": "Paris"}>'
    assert _rendered(templated, AGENT) == want + '<tool id=call_1>sunny<assistant>'


def test_tool_call_arguments_reach_templates_as_an_object_and_empty_calls_are_left_out(templated):
    """As vLLM hands them over: templates render arguments with tojson (a string came out
    double-encoded), and index tool_calls[0] when the key is there (an empty list failed)."""
    rendered = _rendered(templated, AGENT)
    assert '{"city": "Paris"}' in rendered and '\\"' not in rendered
    odd = [AGENT[0], {**AGENT[1], "tool_calls": [{**AGENT[1]["tool_calls"][0],
                                                  "function": {"name": "f", "arguments": "not json"}}]}]
    assert '<call call_1 f "not json">' in _rendered(templated, odd)      # not JSON: kept as text
    empty = [AGENT[0], {"role": "assistant", "content": "ok", "tool_calls": []}]
    assert _rendered(templated, empty) == _rendered(templated, [AGENT[0], {"role": "assistant", "content": "ok"}])


def test_tool_calls_in_the_plain_template(plain):
    assert _rendered(plain, AGENT) == ('user: weather in Paris?\n\nassistant: \n[tool call call_1: get_weather('
                                       '{"city": "Paris"})]\n\ntool (call_1): sunny\n\nassistant:')
    assert _rendered(plain, AGENT[:1]) == "user: weather in Paris?\n\nassistant:"     # as before: same prefixes


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "content": "", "tool_calls": {"id": "x"}}, "messages[1].tool_calls"),
    ({"role": "user", "content": "", "tool_calls": []}, "messages[1].tool_calls"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                            "arguments": "{}"}}]},
     "messages[1].tool_calls[0]"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "name": ["a"]}, "messages[1].name"),
])
def test_bad_tool_fields_are_400s_naming_them(plain, message, param):
    body = {"model": MODEL, "messages": [AGENT[0], message]}
    _error(plain.post("/v1/chat/completions", json=body), 400, param, "invalid_value")


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"50256": -100}), ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("suffix", "def f():"), ("min_tokens", 8), ("repetition_penalty", 1.2),
    # logprobs 0 asks a completion for the sampled tokens' logprobs (it was answered without them)
    ("logprobs", 0), ("top_logprobs", 2), ("function_call", {"name": "f"}), ("modalities", ["text", "audio"]),
    # vLLM's own fields that shape the output were answered as if absent
    ("guided_choice", ["yes", "no"]), ("guided_json", {"type": "object"}), ("guided_regex", "a+"),
    ("structured_outputs", {"choice": ["a"]}), ("allowed_token_ids", [65]), ("bad_words", ["x"]),
    ("prompt_logprobs", 1), ("use_beam_search", True), ("truncate_prompt_tokens", 8), ("logits_processors", ["p"]),
])
def test_fields_the_engine_cannot_honour_are_refused(plain, field, value):
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": AGENT[:1]})):
        err = _error(plain.post(route, json={"model": MODEL, **body, field: value}), 400, field, "unsupported")
        assert field in err["message"]


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {}), ("response_format", {"type": "text"}), ("tool_choice", "auto"), ("tool_choice", "none"),
    ("suffix", ""), ("top_k", -1), ("top_k", 0), ("min_p", 0), ("min_tokens", 0), ("repetition_penalty", 1.0),
])
def test_their_neutral_values_are_accepted(field, value):
    assert P.parse_completion({"model": MODEL, "prompt": "hi", field: value}).prompt == "hi"


@pytest.mark.parametrize("route,field,value,neutral", [
    ("/v1/completions", "add_special_tokens", False, True),
    ("/v1/chat/completions", "add_special_tokens", True, False),
    ("/v1/chat/completions", "chat_template", "{{ 'zzz' }}", None),
    ("/v1/chat/completions", "chat_template_kwargs", {"enable_thinking": False}, {}),
    ("/v1/chat/completions", "add_generation_prompt", False, True),
    ("/v1/chat/completions", "continue_final_message", True, False),
])
def test_vllm_prompt_fields_are_refused_unless_they_ask_for_what_is_done(plain, route, field, value, neutral):
    """A completion's text gets a BOS and a chat's template places its own, as vLLM's
    defaults do: asking otherwise (or for another template) was answered as if not asked."""
    body = {"prompt": "hi"} if route == "/v1/completions" else {"messages": AGENT[:1]}
    _error(plain.post(route, json={"model": MODEL, **body, field: value}), 400, field, "unsupported")
    if neutral is not None:
        parse = P.parse_completion if route == "/v1/completions" else P.parse_chat
        parse({"model": MODEL, **body, field: neutral})


def test_n_is_an_integer_and_text_parts_join_as_vllm_joins_them(plain):
    for v in (True, "2"):
        _error(plain.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": v}), 400, "n", "invalid_value")
    msgs = P.parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert msgs[0]["content"] == "a\nb"


def test_a_refused_session_id_is_not_echoed(plain):
    r = plain.get("/v1/models", headers={"x-session-affinity": "s" * 257})
    assert "x-session-affinity" not in r.headers
    r = plain.get("/v1/models", headers={"x-session-affinity": "s1"})
    assert r.headers["x-session-affinity"] == "s1"


def test_any_int64_seed_is_accepted_and_maps_as_torch_maps_it():
    import torch

    def seed(v):
        return P.parse_completion({"model": MODEL, "prompt": "hi", "seed": v}).seed

    assert seed(-1) == 2**64 - 1 and seed(-2**63) == 2**63 and seed(7) == 7
    a, b = torch.Generator().manual_seed(-1), torch.Generator().manual_seed(seed(-1))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    for bad in (-2**63 - 1, 2**64, 1.5, True):
        with pytest.raises(P.ApiError) as e:
            seed(bad)
        assert e.value.param == "seed"


def test_context_error_blames_max_tokens_only_when_the_client_sent_it(plain):
    long = "x" * (CONTEXT - 2)          # BOS + 8,190 bytes: 8,191 tokens, room for one more
    body = {"model": MODEL, "prompt": long}
    _error(plain.post("/v1/completions", json=body), 400, "prompt", "context_length_exceeded")   # default 16
    _error(plain.post("/v1/completions", json={**body, "max_tokens": 16}), 400, "max_tokens", "context_length_exceeded")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": CONTEXT}
    err = _error(plain.post("/v1/chat/completions", json=chat), 400, "max_completion_tokens", "context_length_exceeded")
    assert err["message"].endswith("lower max_completion_tokens")      # it said max_tokens, which it was not sent


def test_models_retrieve(plain):
    card = plain.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    assert card.json() == plain.get("/v1/models").json()["data"][0]
    _error(plain.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    _error(plain.get("/v1/models/org/gpt-4"), 404, "model", "model_not_found")
    # an OpenAI client whose base_url lacks /v1 got a bare "no such route"
    assert "the API is under /v1" in _error(plain.post("/chat/completions", json={}), 404, None, "not_found")["message"]
    assert "the API is under /v1" in _error(plain.get("/models"), 404, None, "not_found")["message"]
    assert "see docs/serve.md" in _error(plain.get("/v2/nothing"), 404, None, "not_found")["message"]


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/jsonx"])
def test_bodies_not_declared_json_are_refused(plain, ctype):
    data = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/kvtier/keys"):
        r = plain.post(route, content=data, headers={} if ctype is None else {"content-type": ctype})
        _error(r, 415, "content-type", "unsupported_media_type")


def test_json_with_a_charset_is_json(plain):
    r = plain.post("/tokenize", content=json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                   headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["count"] == 3


# -- signed hand-overs (serve/disagg.py, serve/roles.py) --------------------------------------

def _key() -> bytes:
    from kvtier.serve.roles import signing_key
    return signing_key(b"0123456789abcdef-api-test-secret")


class Hints:
    """A decode worker's HandoffDirectory, recording the hints it is given."""

    def __init__(self) -> None:
        self.hints: list[tuple[list[bytes], str]] = []

    def hint(self, keys: list[bytes], node: str) -> None:
        self.hints.append((keys, node))


class NoPush:
    """A Pusher that must not be used."""

    blocks = bytes = failures = 0
    seconds = 0.0

    def push(self, *_a, **_k):
        raise AssertionError("nothing may be pushed")


def _decode_worker(node: str = "127.0.0.1:9002") -> tuple[TestClient, Service, Hints]:
    hints = Hints()
    svc = _service(disagg=Disagg("decode", node=node, key=_key(), handoff=hints, pusher=NoPush()))
    return TestClient(build_app(svc), raise_server_exceptions=False), svc, hints


PREFILL_NODE = "10.1.2.3:9001"
LONG = "x" * 40                      # BOS + 40 bytes: 41 tokens, 2 full blocks before the last token


def _handoff(node: str = PREFILL_NODE, keys: list[bytes] | None = None, **extra) -> dict:
    from kvtier.serve.roles import HANDOFF, sign
    keys = _keys([256] + [ord("x")] * 40)[:2] if keys is None else keys
    return {"node": node, "keys": [k.hex() for k in keys], "signature": sign(_key(), HANDOFF, node, keys), **extra}


def test_a_signed_handoff_is_taken():
    client, svc, hints = _decode_worker()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": LONG, P.HANDOFF_FIELD: _handoff()})
    assert r.status_code == 200, r.text
    assert hints.hints == [(_keys([256] + [ord("x")] * 40)[:2], PREFILL_NODE)] and len(svc.engine.subs) == 1


def _forged() -> list[dict]:
    from kvtier.serve.roles import PUSH_TARGET, sign
    good = _handoff()
    return [{k: v for k, v in good.items() if k != "signature"},                  # unsigned
            {**good, "signature": None}, {**good, "signature": "zz"}, {**good, "signature": 7},
            {**good, "node": "10.6.6.6:22"},                                          # another node
            {**good, "keys": good["keys"][:1]},                                       # other keys
            {**good, "signature": good["signature"].upper()[:-2] + "00"},
            {**good, "signature": sign(_key(), PUSH_TARGET, PREFILL_NODE, [])},     # another purpose's
            _handoff(keys=[]) | {"node": "10.6.6.6:22"}]


@pytest.mark.parametrize("i", range(len(_forged())))
@pytest.mark.parametrize("route,body", [("/v1/completions", {"prompt": LONG}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]})])
def test_an_unsigned_or_tampered_handoff_is_refused(i, route, body):
    client, svc, hints = _decode_worker()
    r = client.post(route, json={"model": MODEL, **body, P.HANDOFF_FIELD: _forged()[i]})
    err = _error(r, 400, P.HANDOFF_FIELD, "invalid_signature")
    assert "signature" in err["message"]
    assert hints.hints == [] and svc.engine.subs == [] and svc.disagg.handed_over == 0


def test_a_handoff_signed_with_another_secret_is_refused():
    from kvtier.serve.roles import HANDOFF, sign, signing_key
    client, _, hints = _decode_worker()
    hand = _handoff()
    hand["signature"] = sign(signing_key(b"another cluster's secret"), HANDOFF, hand["node"],
                             [bytes.fromhex(k) for k in hand["keys"]])
    _error(client.post("/v1/completions", json={"model": MODEL, "prompt": LONG, P.HANDOFF_FIELD: hand}),
           400, P.HANDOFF_FIELD, "invalid_signature")
    assert hints.hints == []


def test_the_load_signs_the_decode_workers_node_as_it_is_reached():
    from kvtier.serve.roles import PUSH_TARGET, signed
    client, _, _ = _decode_worker(node="0.0.0.0:9002")
    load = client.get("/kvtier/load").json()
    assert load["node"] == "testserver:9002"              # the wildcard, as this request reached the worker
    assert signed(_key(), PUSH_TARGET, load["node"], [], load["node_signature"])


@pytest.mark.parametrize("push_to", ["10.6.6.6:22", {"node": "10.6.6.6:22"}, {"node": "10.6.6.6:22", "signature": "00"},
                                     "signed for another node", "a hand-over's signature"])
def test_a_prefill_worker_pushes_only_to_a_signed_decode_node(push_to):
    from kvtier.serve.roles import HANDOFF, PUSH_TARGET, sign
    if push_to == "signed for another node":
        push_to = {"node": "10.6.6.6:22", "signature": sign(_key(), PUSH_TARGET, "10.0.0.2:9002")}
    elif push_to == "a hand-over's signature":
        push_to = {"node": "10.6.6.6:22", "signature": sign(_key(), HANDOFF, "10.6.6.6:22")}
    svc = _service(disagg=Disagg("prefill", node="127.0.0.1:9001", key=_key(), pusher=NoPush()))
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    r = client.post("/kvtier/prefill", json={"api": "completions", "request": {"model": MODEL, "prompt": LONG},
                                             "push_to": push_to})
    _error(r, 400, "push_to", "invalid_value" if isinstance(push_to, str) else "invalid_signature")
    assert svc.engine.subs == []


def test_push_to_in_a_v1_body_is_no_push():
    """push_to is read on the internal /kvtier/prefill only: in a client's body it is an unknown field."""
    svc = _service(disagg=Disagg("prefill", node="127.0.0.1:9001", key=_key(), pusher=NoPush()))
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": LONG, "push_to": "10.6.6.6:22"})
    assert r.status_code == 200 and len(svc.engine.subs) == 1


# -- stop_token_ids: the stop token's text and stop_reason, as vLLM answers them ---------------

EOS = ByteTokenizer(512).eos_token_id


def _generating(ids: list[int], reason: str) -> tuple[TestClient, Service]:
    """A server whose engine answers every request with `ids` (in two steps), then `reason`."""
    svc = _service()
    svc.engine.script = lambda sub: [Tokens(ids[:1]), Tokens(ids[1:]), Finished(reason, len(sub.prompt), len(ids), {})]
    return TestClient(build_app(svc), raise_server_exceptions=False), svc


def _streamed(client: TestClient, route: str, body: dict) -> list[dict]:
    with client.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"]
    return (choice.get("message") or choice.get("delta", {})).get("content") or ""


ROUTES = [("/v1/completions", {"prompt": "hi"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize("route,body", ROUTES)
@pytest.mark.parametrize("ids,reason,extra,text,stop_reason", [
    ([104, 105, 46], "stop", {"stop_token_ids": [46]}, "hi", 46),                              # "." stopped it
    ([104, 105, 46], "stop", {"stop_token_ids": [46], "include_stop_str_in_output": True}, "hi.", 46),
    ([104, 105, EOS], "stop", {}, "hi", None),                                                 # EOS: no stop_reason
    ([104, 105, EOS], "stop", {"stop_token_ids": [EOS]}, "hi", None),                         # EOS is checked first
    ([104, 105, EOS], "stop", {"stop_token_ids": [EOS], "ignore_eos": True}, "hi", EOS),
    ([104, 105, 46], "length", {"stop_token_ids": [46]}, "hi.", None),                        # not stopped by it
])
def test_a_stop_tokens_text_is_left_out_and_named_in_stop_reason(route, body, ids, reason, extra, text, stop_reason):
    client, _ = _generating(ids, reason)
    full = {"model": MODEL, **body, **extra}
    r = client.post(route, json={**full, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (_text(choice), choice["finish_reason"], choice["stop_reason"]) == (text, reason, stop_reason)
    assert choice["token_ids"] == ids                                                          # the id stays
    chunks = [c["choices"][0] for c in _streamed(client, route, full)]
    assert "".join(_text(c) for c in chunks) == text
    assert [c["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop_reason]
    assert chunks[-1]["finish_reason"] == reason


def test_include_stop_str_in_output_must_be_a_bool():
    _error(_client().post("/v1/completions", json={"model": MODEL, "prompt": "hi", "include_stop_str_in_output": "no"}),
           400, "include_stop_str_in_output", "invalid_value")


# -- max_model_len: what one request may hold here --------------------------------------------

SMALL_PAGES = 102                     # a KV cache of 102 pages of 16 tokens: 1,632 of the context's 8,192


def test_max_model_len_is_what_the_kv_cache_holds_when_that_is_less_than_the_context():
    client = _client(request_pages=SMALL_PAGES)
    limit = SMALL_PAGES * BT
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == limit
    assert client.get(f"/v1/models/{MODEL}").json()["max_model_len"] == limit
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).json()["max_model_len"] == limit
    fits = {"model": MODEL, "prompt": "x" * (limit - 2), "max_tokens": 1}     # BOS + limit - 2 bytes + 1
    assert client.post("/v1/completions", json=fits).status_code == 200
    err = _error(client.post("/v1/completions", json={**fits, "max_tokens": 2}), 400, "max_tokens",
                 "context_length_exceeded")
    assert f"maximum context length is {limit} tokens" in err["message"] and str(CONTEXT) in err["message"]
    _error(client.post("/v1/completions", json={**fits, "prompt": "x" * limit}), 400, "prompt",
           "context_length_exceeded")


def test_max_model_len_is_the_context_when_the_kv_cache_holds_more(plain):
    assert plain.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    err = _error(plain.post("/v1/completions", json={"model": MODEL, "prompt": "x" * CONTEXT}), 400, "prompt",
                 "context_length_exceeded")
    assert f"maximum context length is {CONTEXT} tokens;" in err["message"]


def test_models_keeps_max_model_len_while_draining():
    svc = _service(request_pages=SMALL_PAGES)
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    svc.draining = True
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == SMALL_PAGES * BT
    assert client.get("/health").status_code == 503


# -- stopping -----------------------------------------------------------------------------------


def test_a_second_stop_signal_ends_the_requests_in_flight_at_once():
    """`kvtier serve`'s second SIGTERM / Ctrl-C calls Service.cut(): the drain stops waiting for
    its (here, hour-long) timeout and ends what is in flight, with an error that says why."""
    import asyncio

    svc = _service()
    ended: list[str] = []

    def fail_all(message: str) -> None:       # as the engine does: each request in flight ends
        ended.append(message)
        svc.end()

    svc.engine.fail_all = fail_all

    async def main() -> None:
        svc.begin()
        drain = asyncio.ensure_future(svc.drain(3600))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not drain.done() and ended == [] and svc.phase == "draining"
        svc.cut()
        await asyncio.wait_for(drain, 60)

    asyncio.run(main())
    assert len(ended) == 1 and "second stop signal" in ended[0]


def test_a_drain_with_nothing_in_flight_ends_at_once_and_cuts_nothing():
    import asyncio

    svc = _service()
    asyncio.run(asyncio.wait_for(svc.drain(3600), 60))
    assert svc.engine.failed == []


# -- top_k and min_p -----------------------------------------------------------------------------


@pytest.mark.parametrize("route,body", ROUTES)
@pytest.mark.parametrize("fields,top_k,min_p", [({}, 0, 0.0), ({"top_k": 40, "min_p": 0.05}, 40, 0.05),
                                                ({"top_k": -1, "min_p": 0}, 0, 0.0), ({"top_k": 1, "min_p": 1}, 1, 1.0)])
def test_top_k_and_min_p_reach_the_sampler(route, body, fields, top_k, min_p):
    svc = _service()
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    r = client.post(route, json={"model": MODEL, **body, "temperature": 0.7, **fields})
    assert r.status_code == 200, r.text
    params = svc.engine.subs[0].params
    assert (params.top_k, params.min_p, params.temperature) == (top_k, min_p, 0.7)


@pytest.mark.parametrize("field,value", [("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", True),
                                         ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"), ("min_p", True)])
def test_bad_top_k_or_min_p_is_a_400_naming_it(plain, field, value):
    for route, body in ROUTES:
        err = _error(plain.post(route, json={"model": MODEL, **body, field: value}), 400, field, "invalid_value")
        assert field in err["message"]


# -- values a client sends are bounded, and never echoed whole -----------------------------------


def test_a_huge_top_k_samples_from_every_token():
    """top_k past int64 reached torch.tensor inside the engine step and failed every request in
    flight (issue found by a review); any k at least the vocabulary keeps every token."""
    from kvtier.engine.sampling import SamplingParams, cut
    probs = torch.softmax(torch.randn(2, 7), dim=-1)
    for k in (7, 8, 2**63, 2**70):
        params = [SamplingParams(temperature=1.0, top_k=k), SamplingParams(temperature=1.0, top_k=3)]
        out = cut(probs.clone(), params)
        assert torch.equal(out[0], probs[0]) and int((out[1] > 0).sum()) == 3


@pytest.mark.parametrize("route,body", ROUTES)
def test_a_huge_top_k_is_taken(route, body):
    svc = _service()
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    r = client.post(route, json={"model": MODEL, **body, "temperature": 0.7, "top_k": 2**63})
    assert r.status_code == 200, r.text
    assert svc.engine.subs[0].params.top_k == 2**63


def test_stop_token_ids_are_taken_once_each_and_at_most_a_bound(plain):
    from kvtier.serve.protocol import MAX_STOP_TOKEN_IDS, parse_completion
    req = parse_completion({"model": MODEL, "prompt": "hi", "stop_token_ids": [5, 3, 5, 3, 5]})
    assert req.stop_token_ids == (5, 3)
    ok = parse_completion({"model": MODEL, "prompt": "hi", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)) * 3})
    assert len(ok.stop_token_ids) == MAX_STOP_TOKEN_IDS
    r = plain.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                            "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))})
    err = _error(r, 400, "stop_token_ids", "invalid_value")
    assert f"at most {MAX_STOP_TOKEN_IDS:,}" in err["message"]


def test_a_stop_token_id_past_the_vocabulary_is_refused_before_the_engine():
    """It reached the engine, which refused it: the client got its 400, but /metrics counted
    an engine failure (finished_reason="error") for each such request."""
    svc = _service()
    client = TestClient(build_app(svc), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stop_token_ids": [3, 512]})
    err = _error(r, 400, "stop_token_ids", "invalid_value")
    assert "[0, 512)" in err["message"] and "got 512" in err["message"]
    assert svc.engine.subs == []
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stop_token_ids": [511]})
    assert r.status_code == 200 and len(svc.engine.subs) == 1


@pytest.mark.parametrize("field,value", [("stop_token_ids", [7] * 100_000 + [-1]), ("stop_token_ids", [None] * 100_000),
                                         ("temperature", [1] * 100_000), ("top_k", "k" * 100_000),
                                         ("model", "m" * 100_000)], ids=["stop-negative", "stop-null", "temperature",
                                                                         "top_k", "model"])
def test_a_bad_value_is_named_not_echoed_whole(plain, field, value):
    body = {"model": MODEL, "prompt": "hi", field: value}
    r = plain.post("/v1/completions", json=body)
    assert r.status_code in (400, 404), r.text
    assert len(r.json()["error"]["message"]) < 300, r.text[:400]


def test_a_body_the_router_takes_is_taken_wrapped_by_its_worker(plain):
    """The router takes a body of 254 levels and wraps it once for /kvtier/keys and
    /kvtier/prefill: the worker refused that (255 levels) as nesting too deep."""
    deep = b"[" * 251 + b"]" * 251                      # + {"messages": [{"content": ...}]}: 254 levels
    body = b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL.encode(), deep)
    r = plain.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert "messages[0].content" in r.text, r.text       # past the depth check: refused for its content
    wrapped = b'{"api": "chat", "request": %s}' % body
    r = plain.post("/kvtier/keys", content=wrapped, headers={"content-type": "application/json"})
    assert "messages[0].content" in r.text, r.text
    r = plain.post("/kvtier/keys", content=b'{"api": "chat", "request": [%s]}' % body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests deeper than 255" in r.text, r.text


def test_a_bug_is_one_500_and_its_traceback_is_logged_once(caplog):
    """Starlette's handler for Exception answered and then re-raised, so the server logged a
    whole traceback for every request that met a bug."""
    svc = _service()

    def crash(_sub):
        raise RuntimeError("a bug")

    svc.engine.script = crash
    client = TestClient(build_app(svc), raise_server_exceptions=True)    # a re-raise fails the test
    with caplog.at_level("ERROR", logger="kvtier.serve"):
        for _ in range(3):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                            headers={"x-session-affinity": "s1"})
            _error(r, 500, None, "internal_error")
            assert "RuntimeError: a bug" in r.json()["error"]["message"] and r.headers["x-session-affinity"] == "s1"
    crashes = [rec for rec in caplog.records if "internal error on POST /v1/completions" in rec.getMessage()]
    assert len(crashes) == 3 and [rec.exc_info is not None for rec in crashes] == [True, False, False]
