"""`kvtier serve`: the reference engine as an OpenAI-compatible HTTP service.

    client -> app.py (routes, Starlette on uvicorn) -> engine_loop.py (the engine's own
    thread: LLM.step in a loop) -> tokens back per request (asyncio queues) -> SSE or JSON

protocol.py validates request bodies and builds response bodies (OpenAI's and vLLM's
conventions), chat.py renders chat messages into a prompt, detok.py turns tokens into
text incrementally, sse.py holds the ASGI pieces (event streams, the affinity header,
error bodies), metrics.py the Prometheus registry, cli.py the command. docs/serve.md.
"""
