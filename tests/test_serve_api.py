"""`kvtier serve`'s request handling without a model: the routes over a stand-in engine that
is ready and never generates (every request here is answered before it would reach the
engine), with a byte-level tokenizer, so what a chat template rendered reads back as text."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from kvtier.engine.tokenizer import ByteTokenizer  # noqa: E402
from kvtier.serve import protocol as P  # noqa: E402
from kvtier.serve.app import Service, build_app  # noqa: E402
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
            "{{ tc.function.arguments }}>{% endfor %}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
AGENT = [{"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _client(tokenizer_dir: Path | None) -> TestClient:
    tok = ByteTokenizer(512)
    llm = SimpleNamespace(tokenizer=tok, info=SimpleNamespace(tokenizer_path=tokenizer_dir),
                          config=SimpleNamespace(max_position_embeddings=CONTEXT, vocab_size=512),
                          adapter=SimpleNamespace(block_tokens=16), request_pages=10_000)
    ready = threading.Event()
    ready.set()
    engine = SimpleNamespace(llm=llm, ready=ready, error=None)
    return TestClient(build_app(Service(engine, ServeMetrics(MODEL), MODEL)), raise_server_exceptions=False)


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
    ("suffix", "def f():"), ("top_k", 40), ("min_p", 0.05), ("min_tokens", 8), ("repetition_penalty", 1.2),
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


def test_models_retrieve(plain):
    card = plain.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    assert card.json() == plain.get("/v1/models").json()["data"][0]
    _error(plain.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    _error(plain.get("/v1/models/org/gpt-4"), 404, "model", "model_not_found")


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
