"""The routes: OpenAI's API (completions, chat, models), vLLM's extras (health, tokenize,
detokenize, metrics), over one EngineLoop.

A generation request is validated and tokenized here, on the event loop, so every bad
request is answered 4xx before it reaches the engine; then it is submitted with a
`deliver` callback that moves the engine thread's events into this request's asyncio
queue. Streams and JSON answers are built from the same incremental detokenizer, so a
streamed answer joins to exactly the non-streamed one.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.serve import protocol as P
from kvtier.serve.chat import ChatFormatter
from kvtier.serve.detok import IncrementalText
from kvtier.serve.engine_loop import EngineLoop, Event, Failed, Finished, Submission, Tokens
from kvtier.serve.metrics import CONTENT_TYPE, ServeMetrics
from kvtier.serve.protocol import ApiError, short_repr
from kvtier.serve.sse import (JSON, SSE_DONE, EventStream, error_response, http_app, read_json,
                              session_of, sse_event, unless_gone)



@dataclass
class Service:
    """What the routes share: the engine, its metrics, and where the server is in its life."""

    engine: EngineLoop
    metrics: ServeMetrics
    model_name: str
    max_body_bytes: int = 4 << 20
    draining: bool = False
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))   # the model card's: when the server started
    disagg: Any = None                # kvtier.serve.disagg.Disagg: the worker's P/D role, or None
    kv_events: Any = None             # kvtier.serve.events.KvEvents, from the first GET /kvtier/events
    _chat: ChatFormatter | None = None
    _idle: asyncio.Event | None = None
    _cut: asyncio.Event | None = None

    # -- life ------------------------------------------------------------------------------
    @property
    def loaded(self) -> bool:
        """The model is loaded (and still is while draining)."""
        return self.engine.ready.is_set() and self.engine.error is None

    @property
    def phase(self) -> str:
        if self.draining:
            return "draining"
        if not self.engine.ready.is_set():
            return "starting"
        return "failed" if self.engine.error is not None else "ready"

    def check_serving(self) -> None:
        phase = self.phase
        if phase != "ready":
            why = {"starting": "the model is still loading", "draining": "the server is shutting down",
                   "failed": "the model failed to load"}[phase]
            raise ApiError(503, f"not serving: {why}; retry on another server or later", code="service_unavailable")

    def begin(self) -> None:
        self.inflight += 1
        self._idle_event().clear()

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle_event().set()

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.inflight == 0:
                self._idle.set()
        return self._idle

    def cut(self) -> None:
        """Stop waiting for the requests in flight (a second SIGTERM or Ctrl-C while draining):
        drain() ends them now, as it would at its timeout."""
        if self._cut is None:
            self._cut = asyncio.Event()
        self._cut.set()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests (503), let those in flight finish for up to `timeout`
        seconds (or until cut()), then end the rest with an error (streams get an error
        chunk and [DONE])."""
        self.draining = True
        idle = self._idle_event()
        if self._cut is None:
            self._cut = asyncio.Event()
        waits = [asyncio.ensure_future(idle.wait()), asyncio.ensure_future(self._cut.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if idle.is_set():
            return
        why = "was cut by a second stop signal" if self._cut.is_set() else \
            f"did not finish within the shutdown timeout ({timeout:g} s)"
        self.engine.fail_all(f"the server is shutting down: this request {why}")
        try:
            await asyncio.wait_for(idle.wait(), 10)
        except asyncio.TimeoutError:
            pass

    # -- the model -------------------------------------------------------------------------
    @property
    def llm(self) -> Any:
        return self.engine.llm

    @property
    def context(self) -> int:
        """The model's context length (positions)."""
        return int(self.llm.config.max_position_embeddings)

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + generated) one request may have here: the model's context,
        or fewer when the KV cache holds fewer for one request. What /v1/models and /tokenize
        report and the context-length error names, so a client sizing prompts by it fits."""
        return min(self.context, self.llm.request_pages * self.llm.adapter.block_tokens)

    def chat(self) -> ChatFormatter:
        if self._chat is None:
            self._chat = ChatFormatter(self.llm.tokenizer, self.llm.info.tokenizer_path)
        return self._chat

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {short_repr(name)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def text_ids(self, text: str, add_special: bool = True) -> list[int]:
        tok = self.llm.tokenizer
        bos = tok.bos_token_id
        return ([bos] if add_special and bos is not None else []) + tok.encode(text)

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Checked messages as the chat template renders them: a template that refuses them
        (its raise_exception, a Jinja error) is the client's 400, not a 500."""
        try:
            return self.chat().token_ids(messages)
        except Exception as e:
            raise P.bad(f"the chat template refused these messages: {e}", "messages") from None

    def prompt_ids(self, req: P.GenerationRequest) -> list[int]:
        if req.messages:
            return self.chat_ids(req.messages)
        if isinstance(req.prompt, str):
            return self.text_ids(req.prompt)
        vocab = self.llm.config.vocab_size
        if any(t >= vocab for t in req.prompt):
            raise P.bad(f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
        return list(req.prompt)

    def sampling(self, req: P.GenerationRequest, n_prompt: int) -> SamplingParams:
        limit = self.max_model_len            # the context, or what the KV cache holds if less
        # Without max_tokens, up to that limit.
        max_tokens = req.max_tokens if req.max_tokens is not None else max(1, limit - n_prompt)
        # The field to blame: the prompt when it alone is too long (with one token to generate)
        # or max_tokens was not sent (a default's, 16 for completions, is not the client's field).
        prompt_alone = n_prompt >= limit
        field = req.max_tokens_field        # as the client named it (max_completion_tokens in a chat)
        param = ("messages" if req.messages else "prompt") if prompt_alone or not req.max_tokens_sent else field
        fix = "shorten the prompt" if prompt_alone else f"shorten the prompt or lower {field}"
        if max_tokens < 1 or n_prompt + max_tokens > limit:
            why = "" if limit == self.context else \
                f" on this server (the model's {self.context}, capped by what its KV cache holds for one request)"
            raise P.bad(f"this model's maximum context length is {limit} tokens{why}; the request asks for "
                        f"{n_prompt + max(max_tokens, 1)} ({n_prompt} in the prompt, {max(max_tokens, 1)} to "
                        f"generate): {fix}", param, "context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                                    stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
            params.check_vocab(self.llm.config.vocab_size)   # here: a 400 is not an engine failure in /metrics
            return params
        except ConfigError as e:
            raise P.bad(str(e), P.sampling_param(str(e))) from None


# -- generation ------------------------------------------------------------------------------


async def generate(svc: Service, request: Request, chat: bool) -> Response | EventStream:
    svc.check_serving()
    session = session_of(request)
    body = await read_json(request, svc.max_body_bytes)
    req = P.parse_chat(body) if chat else P.parse_completion(body)
    svc.check_model(req.model)
    ids = svc.prompt_ids(req)
    params = svc.sampling(req, len(ids))
    if svc.disagg is not None:
        from kvtier.serve.disagg import accept_handoff
        accept_handoff(svc, body, ids)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[list[Event]] = asyncio.Queue()

    def deliver(batch: list[Event]) -> None:       # on the engine thread
        loop.call_soon_threadsafe(events.put_nowait, batch)

    svc.begin()
    svc.engine.submit(Submission(rid, ids, params, session, deliver))
    answer = _Answer(svc, rid, req, chat, len(ids))
    if req.stream:
        return EventStream(answer.stream(events), on_close=answer.close)
    try:
        return await answer.collect(events, request)
    finally:
        answer.close()


class _Answer:
    """One request's answer, streamed or whole, from its engine events."""

    def __init__(self, svc: Service, rid: str, req: P.GenerationRequest, chat: bool, n_prompt: int) -> None:
        self.svc, self.rid, self.req, self.chat, self.n_prompt = svc, rid, req, chat, n_prompt
        self.created = int(time.time())       # OpenAI's `created`: when this request arrived
        self.text = IncrementalText(svc.llm.tokenizer)
        self.over = False
        self.stop_reason: int | None = None   # vLLM's: the stop token id that ended it (None: EOS, length)
        self.held: list[int] = []             # the stop token: in token_ids, not in the text
        self._closed = False

    def close(self) -> None:
        """The response is done or its client went away: abort the request if still running."""
        if self._closed:
            return
        self._closed = True
        if not self.over:
            self.svc.engine.abort(self.rid)
            self.svc.metrics.outcome("abort")
        self.svc.end()

    def _usage(self, done: Finished) -> dict:
        return P.usage(done.prompt_tokens, done.completion_tokens, done.cached_by_tier)

    def _visible(self, batch: list[Event]) -> list[Event]:
        """`batch` with the token that stopped the request (a stop token or EOS) kept out of
        the text, as vLLM does unless include_stop_str_in_output (it stays in token_ids); and
        stop_reason noted: the id when one of stop_token_ids ended it, None for EOS."""
        done = batch[-1] if batch else None
        last = next((i for i in range(len(batch) - 1, -1, -1) if isinstance(batch[i], Tokens) and batch[i].ids), None)
        if not isinstance(done, Finished) or done.reason != "stop" or last is None:
            return batch
        tok = batch[last].ids[-1]
        r = self.req
        if tok in r.stop_token_ids and (r.ignore_eos or tok != self.svc.llm.eos):   # EOS first, as vLLM checks
            self.stop_reason = tok
        if r.include_stop_str_in_output:
            return batch
        self.held = [tok]
        return batch[:last] + [Tokens(batch[last].ids[:-1])] + batch[last + 1:]

    def _chunk(self, piece: str, finish: str | None) -> dict:
        r = self.req
        if self.chat:
            delta = {"content": piece} if piece or finish is None else {}
            return P.chat_chunk(self.rid, self.created, r.model, delta, finish, r.include_usage,
                                self.stop_reason if finish else None)
        return P.completion_chunk(self.rid, self.created, r.model, piece, finish, r.include_usage,
                                  self.stop_reason if finish else None)

    async def stream(self, events: asyncio.Queue[list[Event]]) -> AsyncIterator[bytes]:
        s, r = self.svc, self.req
        if self.chat:
            yield sse_event(P.chat_chunk(self.rid, self.created, r.model, {"role": "assistant", "content": ""}, None,
                                         r.include_usage))
        while True:
            for ev in self._visible(await events.get()):
                if isinstance(ev, Tokens):
                    piece = self.text.push(ev.ids)
                    if piece:
                        yield sse_event(self._chunk(piece, None))
                elif isinstance(ev, Finished):
                    self.over = True
                    s.metrics.outcome(ev.reason)
                    yield sse_event(self._chunk(self.text.push([], final=True), ev.reason))
                    if r.include_usage:
                        yield sse_event(P.usage_chunk(self.rid, self.created, r.model, self.chat, self._usage(ev)))
                    yield SSE_DONE
                    return
                elif isinstance(ev, Failed):
                    self.over = True
                    s.metrics.outcome("error")
                    yield sse_event(ApiError(ev.status, ev.message, param=ev.param, code=ev.code).body())
                    yield SSE_DONE
                    return

    async def collect(self, events: asyncio.Queue[list[Event]], request: Request) -> Response:
        """The whole answer, or ClientGone (499) if its client disconnects first (then
        close() aborts the request)."""
        return await unless_gone(request.receive, self._collect(events))

    async def _collect(self, events: asyncio.Queue[list[Event]]) -> Response:
        s, r = self.svc, self.req
        while True:
            for ev in self._visible(await events.get()):
                if isinstance(ev, Tokens):
                    self.text.push(ev.ids)
                elif isinstance(ev, Finished):
                    self.over = True
                    s.metrics.outcome(ev.reason)
                    self.text.push([], final=True)
                    build = P.chat_body if self.chat else P.completion_body
                    ids = self.text.ids + self.held if r.return_token_ids else None
                    return JSON(build(self.rid, self.created, r.model, self.text.text, ev.reason, self._usage(ev), ids,
                                      self.stop_reason))
                elif isinstance(ev, Failed):
                    self.over = True
                    s.metrics.outcome("error")
                    return error_response(ApiError(ev.status, ev.message, param=ev.param, code=ev.code))


# -- the other routes ------------------------------------------------------------------------


def build_app(svc: Service) -> Any:
    """The ASGI application (kvtier.serve.sse.http_app of the routes below)."""

    async def completions(request: Request) -> Any:
        return await generate(svc, request, chat=False)

    async def chat_completions(request: Request) -> Any:
        return await generate(svc, request, chat=True)

    def card() -> dict[str, Any]:
        """The served model's card, as GET /v1/models lists it."""
        out = {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "kvtier",
               "root": svc.model_name, "parent": None}
        if svc.loaded:                            # ready or draining: what a request may hold here
            out["max_model_len"] = svc.max_model_len
        return out

    async def models(_request: Request) -> Response:
        return JSON({"object": "list", "data": [card()]})

    async def model(request: Request) -> Response:
        """GET /v1/models/{id} (the openai SDK's models.retrieve): the card, or 404 model_not_found."""
        svc.check_model(request.path_params["model"])
        return JSON(card())

    async def health(_request: Request) -> Response:
        phase = svc.phase
        return JSON({"status": phase}, status_code=200 if phase == "ready" else 503)

    async def model_request(request: Request) -> dict[str, Any]:
        """The JSON object body of a request to the served model (503 unless serving, 400, 404)."""
        svc.check_serving()
        body = await read_json(request, svc.max_body_bytes)
        if not isinstance(body, dict):
            raise P.bad("the request body must be a JSON object")
        svc.check_model(body.get("model"))
        return body

    async def tokenize(request: Request) -> Response:
        body = await model_request(request)
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise P.bad("add_special_tokens must be true or false", "add_special_tokens")
        if "messages" in body:
            ids = svc.chat_ids(P.parse_messages(body["messages"]))
        elif isinstance(body.get("prompt"), str):
            ids = svc.text_ids(body["prompt"], add_special)
        else:
            raise P.bad("give prompt (text) or messages", "prompt")
        return JSON({"count": len(ids), "max_model_len": svc.max_model_len, "tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await model_request(request)
        tokens, vocab = body.get("tokens"), svc.llm.config.vocab_size
        if not isinstance(tokens, list) or not all(P._is_int(t) and 0 <= t < vocab for t in tokens):
            raise P.bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return JSON({"prompt": svc.llm.tokenizer.decode(tokens)})

    async def prefill(request: Request) -> Response:
        from kvtier.serve.disagg import prefill as run_prefill
        return await run_prefill(svc, request)

    async def keys(request: Request) -> Response:
        from kvtier.serve.disagg import block_keys
        return await block_keys(svc, request)

    async def events(request: Request) -> Response:
        from kvtier.serve.events import MAX_BATCH, KvEvents

        svc.check_serving()
        q = request.query_params
        try:
            since, limit = int(q.get("since", "0")), int(q.get("limit", str(MAX_BATCH)))
        except ValueError:
            raise P.bad("since and limit must be integers", "since") from None
        if since < 0:
            raise P.bad(f"since must be an event number >= 0, got {since}", "since")
        if limit < 1:
            raise P.bad(f"limit must be >= 1 (an answer holds at most {MAX_BATCH} events), got {limit}", "limit")
        if svc.kv_events is None:                 # from the first router that asks: idle costs nothing
            svc.kv_events = KvEvents(svc.llm.store)
        try:
            return JSON(svc.kv_events.since(since, limit, epoch=q.get("epoch"), cursor=q.get("cursor")))
        except ValueError:
            raise P.bad("cursor must be the one a snapshot page answered", "cursor") from None

    async def load(request: Request) -> Response:
        from kvtier.serve.disagg import Disagg
        return JSON((svc.disagg or Disagg()).load(svc, request))

    async def metrics(_request: Request) -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/kvtier/prefill", prefill, methods=["POST"]),
        Route("/kvtier/load", load, methods=["GET"]),
        Route("/kvtier/keys", keys, methods=["POST"]),
        Route("/kvtier/events", events, methods=["GET"]),
    ]
    return http_app(routes)
