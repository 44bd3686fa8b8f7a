"""Request bodies in, response bodies out: OpenAI's /v1/completions and /v1/chat/completions
with vLLM's conventions (usage.prompt_tokens_details.cached_tokens, OpenAI error bodies).

Every field the engine can honour is checked here, at the boundary, and a bad one is an
`ApiError` (HTTP 400) naming the field; fields the engine cannot honour (n > 1, logprobs,
penalties, stop strings) are refused rather than silently ignored. Unknown fields are
ignored, as OpenAI-compatible servers do, so clients that send extras keep working.
"""
from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

TIERS = ("device", "host", "disk", "remote")   # where cached prompt tokens can come from
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1         # vLLM takes any int64; torch.Generator seeds are uint64
MAX_STOP_TOKEN_IDS = 1024                     # distinct stop ids a request may give
HANDOFF_FIELD = "kvtier_handoff"              # a decode worker's hand-over (serve/disagg.py): router-made
INTERNAL_FIELDS = (HANDOFF_FIELD,)            # body fields a router sets, never passed on from a client


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """What both endpoints ask of the engine, validated."""

    model: str
    max_tokens: int | None            # None: up to the model's context
    max_tokens_sent: bool = False     # the client gave max_tokens (else a default: not the field to blame)
    max_tokens_field: str = "max_tokens"   # the name it came as (chat: max_completion_tokens too)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # vLLM's: the k most likely tokens; 0 or -1: all
    min_p: float = 0.0                # vLLM's: drop tokens below min_p x the top token's probability
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False   # vLLM's: keep the stop token's text (its id stays in token_ids)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False    # vLLM's extension: choices[0].token_ids (non-streamed answers)
    prompt: str | list[int] = ""     # /v1/completions: text or token ids
    messages: list[dict[str, Any]] = field(default_factory=list)   # /v1/chat/completions


# -- field checks ------------------------------------------------------------------------


# A client's value in an error message is cut short (a list may be megabytes; repr of it
# in full took 0.4 s and sent it all back).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict = 2, 4, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = 40


def short_repr(v: Any) -> str:
    """A client's value for an error message, at most a few dozen characters."""
    return _REPR.repr(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < lo or v > hi or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"{name} must be a number in {interval}, got {short_repr(v)}", name)
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        # JSON integers past 64 bits reach here as floats (1e+23): say why it is one
        got = short_repr(v) + (" (a number this large is read as a float)" if isinstance(v, float) and
                               math.isfinite(v) and v.is_integer() and abs(v) >= 2**63 else "")
        raise bad(f"{name} must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {got}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {short_repr(v)}", name)
    return v


# The request's fields that become SamplingParams, as the engine names them in its errors.
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos"})


def sampling_param(message: str) -> str | None:
    """The field an engine's refusal of a sampling setting names first (its messages start
    with it: "stop_token_ids must be ..."), for the error's `param`."""
    name = message.split(" ", 1)[0]
    return name if name in SAMPLING_FIELDS else None


def _unsupported(body: dict, chat: bool) -> None:
    """Refuse what the engine cannot do, instead of answering something else."""
    for name in ("n", "best_of"):
        v = body.get(name)
        if v is not None and not _is_int(v):
            raise bad(f"{name} must be an integer, got {short_repr(v)}", name)
        if v is not None and v != 1:
            raise bad(f"{name} must be 1 (one choice per request), got {short_repr(v)}", name, "unsupported")
    # logprobs 0 asks a completion for the sampled tokens' logprobs (a chat's is true/false)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if (logprobs is not None and logprobs is not False) or (top is not None and (top != 0 or isinstance(top, bool))):
        name = "logprobs" if logprobs is not None and logprobs is not False else "top_logprobs"
        raise bad(f"{name} is not supported by this server", name, "unsupported")
    if body.get("echo") not in (None, False):
        raise bad("echo is not supported by this server", "echo", "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v not in (None, 0, 0.0) or isinstance(v, bool):
            raise bad(f"{name} is not supported by this server (leave it 0)", name, "unsupported")
    if body.get("stop") not in (None, [], ""):
        raise bad("stop strings are not supported by this server; use stop_token_ids", "stop", "unsupported")
    if body.get("tools") or body.get("functions"):
        raise bad("tools are not supported by this server", "tools", "unsupported")
    # what would change the answer if honoured: sent with its no-op value it is fine
    for name, neutral, boolean, fix in _NEUTRAL_BY_ROUTE[chat]:
        v = body.get(name)
        if v is not None and (isinstance(v, bool) != boolean or v not in neutral):
            raise bad(f"{name} is not supported by this server ({fix}), got {short_repr(v)}", name, "unsupported")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad(f"tool_choice {short_repr(choice)} is not supported by this server: tools are not (leave it out, or "
                  "\"auto\" or \"none\")", "tool_choice", "unsupported")


# Fields the engine cannot honour, the values that ask for nothing, and what to do instead.
_NEUTRAL: tuple[tuple[str, tuple, str], ...] = (
    ("logit_bias", ({},), "leave it out or empty"),
    ("response_format", ({"type": "text"},), "leave it out or {\"type\": \"text\"}: no JSON mode or schemas"),
    ("suffix", ("",), "leave it out: no insertion"),
    ("min_tokens", (0,), "leave it out or 0"),
    ("repetition_penalty", (1,), "leave it out or 1"),
    ("function_call", ("auto", "none"), "functions are not supported: leave it out, or \"auto\" or \"none\""),
    ("modalities", (["text"],), "text only: leave it out or [\"text\"]"),
    # vLLM's own fields: an output they would shape is refused, not answered without them
    ("guided_json", (), "no guided decoding"),
    ("guided_regex", (), "no guided decoding"),
    ("guided_choice", (), "no guided decoding"),
    ("guided_grammar", (), "no guided decoding"),
    ("structured_outputs", (), "no guided decoding"),
    ("allowed_token_ids", (), "no restricted vocabulary"),
    ("bad_words", ([],), "leave it out or empty"),
    ("logits_processors", ([],), "leave it out or empty"),
    ("prompt_logprobs", (), "no logprobs"),
    ("use_beam_search", (False,), "no beam search: leave it out or false"),
    ("length_penalty", (1,), "no beam search: leave it out or 1"),
    ("truncate_prompt_tokens", (), "prompts are never truncated: shorten the prompt"),
)
# The same, where completions and chats differ: a text prompt gets a BOS (vLLM's
# add_special_tokens, true for completions), a chat's template places its own (false).
_NEUTRAL_COMPLETION: tuple[tuple[str, tuple, str], ...] = (
    ("add_special_tokens", (True,), "a text prompt always gets the BOS: leave it out or true"),
)
_NEUTRAL_CHAT: tuple[tuple[str, tuple, str], ...] = (
    ("add_special_tokens", (False,), "the chat template places the special tokens: leave it out or false"),
    ("chat_template", (), "the model's own template is used"),
    ("chat_template_kwargs", ({},), "the model's own template is used as it is: leave it out or empty"),
    ("add_generation_prompt", (True,), "the assistant's turn is always opened: leave it out or true"),
    ("continue_final_message", (False,), "a final assistant message is not continued: leave it out or false"),
    ("documents", ([],), "leave it out or empty"),
)
# Per route (chat or not), each field with whether its neutral values are booleans (a bool
# is never taken for 0 or 1, nor 0 or 1 for a bool): built once, not per request.
_NEUTRAL_BY_ROUTE = {chat: tuple((name, neutral, any(isinstance(x, bool) for x in neutral), fix)
                                 for name, neutral, fix in _NEUTRAL + extra)
                     for chat, extra in ((False, _NEUTRAL_COMPLETION), (True, _NEUTRAL_CHAT))}


def _common(body: Any, max_tokens_names: tuple[str, ...], chat: bool) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the name GET /v1/models lists", "model")
    _unsupported(body, chat)
    max_tokens, field = None, "max_tokens"
    for name in max_tokens_names:
        v = _int(body, name, 1)
        if v is not None:
            max_tokens, field = v, name
            break
    seed = _int(body, "seed", MIN_SEED, MAX_SEED)
    if seed is not None:
        seed %= MAX_SEED + 1           # a negative seed (int64, as vLLM takes) as its two's complement, as torch does
    stops = body.get("stop_token_ids")
    if stops is None:
        stops = []
    if not isinstance(stops, list):
        raise bad(f"stop_token_ids must be a list of token ids (integers >= 0), got {type(stops).__name__}",
                  "stop_token_ids")
    for t in stops:
        if not (_is_int(t) and t >= 0):      # named, not the list echoed: it may be megabytes
            raise bad(f"stop_token_ids must be token ids (integers >= 0), got {short_repr(t)} among them",
                      "stop_token_ids")
    stops = list(dict.fromkeys(stops))        # a stop id given twice stops the same way once
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise bad(f"stop_token_ids has {len(stops):,} distinct ids; at most {MAX_STOP_TOKEN_IDS:,} are taken",
                  "stop_token_ids")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options must be an object such as {\"include_usage\": true}", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        include_usage = _bool(opts, "include_usage")
    return GenerationRequest(
        model=model, max_tokens=max_tokens, max_tokens_sent=max_tokens is not None, max_tokens_field=field,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(_int(body, "top_k", -1) or 0, 0), min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed, stop_token_ids=tuple(stops), ignore_eos=_bool(body, "ignore_eos"),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        stream=stream, include_usage=include_usage, return_token_ids=_bool(body, "return_token_ids"))


def parse_completion(body: Any) -> GenerationRequest:
    """A /v1/completions body: one prompt, as text or token ids (or a list holding one)."""
    req = _common(body, ("max_tokens",), chat=False)
    if "max_tokens" not in body or body.get("max_tokens") is None:
        req.max_tokens = 16                      # OpenAI's and vLLM's default for completions
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                       # ["text"] or [[1, 2, 3]]: one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty: give at least one character or token", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise bad("prompt token ids must be integers >= 0", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"this server takes one prompt per request, got {len(prompt)}: send one request each",
                  "prompt", "unsupported")
    else:
        raise bad("prompt must be text or a list of token ids", "prompt")
    req.prompt = prompt
    return req


def parse_chat(body: Any) -> GenerationRequest:
    """A /v1/chat/completions body: messages with a role and text content."""
    req = _common(body, ("max_completion_tokens", "max_tokens"), chat=True)
    req.messages = parse_messages(body.get("messages"))
    return req


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """[{"role", "content"}] with text content (a string, or a list of {"type": "text"} parts),
    and the fields an agent's history carries, checked and kept for the chat template (as vLLM
    passes them): `name`, an assistant's `tool_calls` ([{"id", "type": "function", "function":
    {"name", "arguments"}}]), a tool result's `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {\"role\": ..., \"content\": ...}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role must be system, developer, user, assistant or tool, got {short_repr(role)}",
                      f"{where}.role")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}} (text only)",
                              f"{where}.content", "unsupported")
                parts.append(part["text"])
            content = "\n".join(parts)          # as vLLM joins text parts
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content must be text", f"{where}.content")
        msg: dict[str, Any] = {"role": role, "content": content}
        for name in ("name", "tool_call_id"):
            v = m.get(name)
            if v is not None:
                if not isinstance(v, str):
                    raise bad(f"{where}.{name} must be a string, got {short_repr(v)}", f"{where}.{name}")
                msg[name] = v
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list of tool calls, on an assistant message",
                          f"{where}.tool_calls")
            if calls:                # an empty list is left out, as vLLM does (templates index calls[0])
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    """One assistant tool call, {"id", "type": "function", "function": {"name", "arguments"}}, checked."""
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(c, dict) or not isinstance(c.get("id"), str) or c.get("type", "function") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments"), str):
        raise bad(f"{where} must be {shape}", where)
    # The JSON text as an object, as vLLM hands it to chat templates (they render it with
    # tojson: a string came out double-encoded); text that is not a JSON object stays text.
    try:
        args: Any = json.loads(fn["arguments"])
    except ValueError:
        args = fn["arguments"]
    if not isinstance(args, dict):
        args = fn["arguments"]
    return {"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}}


# -- response bodies ------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_by_tier: dict[str, int]) -> dict[str, Any]:
    """usage with prompt_tokens_details.cached_tokens and kvtier's split of them by tier (tokens)."""
    by_tier = {t: int(cached_by_tier.get(t, 0)) for t in TIERS}
    for t, n in cached_by_tier.items():       # a remote tier with another name counts as remote
        if t not in by_tier:
            by_tier["remote"] += int(n)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(by_tier.values()), "kvtier_cached_by_tier": by_tier}}


def completion_body(rid: str, created: int, model: str, text: str, finish: str | None,
                    use: dict | None, token_ids: list[int] | None = None,
                    stop_reason: int | None = None) -> dict[str, Any]:
    """A whole /v1/completions answer. `stop_reason` (vLLM's): the stop token id that ended
    it, None for EOS, length or no end yet."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": use}


def chat_body(rid: str, created: int, model: str, text: str, finish: str | None, use: dict | None,
              token_ids: list[int] | None = None, stop_reason: int | None = None) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None,
                     with_usage: bool, stop_reason: int | None = None) -> dict[str, Any]:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop_reason}]}
    if with_usage:
        body["usage"] = None
    return body


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, str], finish: str | None,
               with_usage: bool, stop_reason: int | None = None) -> dict[str, Any]:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop_reason}]}
    if with_usage:
        body["usage"] = None
    return body


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict) -> dict[str, Any]:
    """The last chunk under stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
