"""`kvtier router`: one OpenAI-compatible address in front of prefill and decode workers.

    kvtier router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000

It may start before its workers: it prints `listening on` at once and `ready: ...` when a
decode worker is ready (and says when none is any longer); GET /health lists them and says
503 until then. SIGTERM or Ctrl-C stops it: no new connections, answers in flight stream on for up
to --shutdown-timeout seconds (5) and are then cut (the client sees a broken stream, never a
second answer), exit 0. It keeps no state a restart needs: a new router reads the workers'
load and KV events afresh. Colocated `kvtier serve` workers (--role both) are listed with --decode and no
--prefill. The router holds little: bodies are bounded (--max-body-size) and so are
connections (--max-connections, uvicorn's limit_concurrency: past it, 503).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from kvtier.errors import ConfigError
from kvtier.progress import say

HELP = "OpenAI-compatible router over prefill/decode workers (`kvtier serve --role ...`), token- and cache-aware"


def url_arg(text: str) -> str:
    """argparse type: http://host:port (no path)."""
    from urllib.parse import urlsplit

    u = urlsplit(text.strip())
    try:
        port, bad_port = u.port, False
    except ValueError:
        port, bad_port = None, True
    why = ""
    if u.scheme not in ("http", "https") or not u.hostname:
        why = "it needs http:// or https:// and a host"
    elif bad_port:
        why = "its port is not a number from 1 to 65535"
    elif u.path not in ("", "/") or u.query or u.fragment:
        root = f"{u.scheme}://{u.netloc}"
        why = f"it has a path: give the server's root URL, {root}, without /v1 or any other path"
    elif port is None:
        why = "it has no port: add the worker's, e.g. :8001"
    if why:
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker URL like http://127.0.0.1:8001: {why}")
    return text.strip().rstrip("/")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import non_negative_int, positive_float, positive_int, size
    from kvtier.router.rules import POLICIES
    from kvtier.serve.cli import port_arg
    from kvtier.serve.http import READ_TIMEOUT_S

    p.add_argument("--prefill", action="extend", nargs="+", type=url_arg, default=[], metavar="URL",
                   help="prefill workers (kvtier serve --role prefill); repeatable, several URLs each")
    p.add_argument("--decode", action="extend", nargs="+", type=url_arg, default=[], metavar="URL",
                   help="decode workers (--role decode), or colocated ones (--role both); repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_arg, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument("--policy", choices=POLICIES, default="kvtier",
                   help="routing rule (docs/disaggregation.md): kvtier (longest cached prefix among balanced "
                        "workers), dynamo (min uncached prefill blocks + decode blocks), sglang (cache-aware)")
    p.add_argument("--handoff", choices=("pull", "push"), default="pull",
                   help="how the prompt's KV reaches the decode worker (docs/disaggregation.md): pull (the decode "
                        "worker fetches it from the prefill worker's node at admission) or push (the router picks the "
                        "decode worker first; the prefill worker sends the blocks to its node before answering)")
    p.add_argument("--prefixes", choices=("events", "text"), default="events",
                   help="what the router knows of each worker's cached prefixes: events (the block keys the "
                        "workers' GET /kvtier/events report, matched against each prompt's keys from POST "
                        "/kvtier/keys; the text index where a worker publishes none) or text (an approximate "
                        "index of what the router sent each worker)")
    p.add_argument("--direct-below", type=non_negative_int, default=256, metavar="TOKENS",
                   help="prompts with fewer uncached tokens than this go straight to a decode worker")
    p.add_argument("--max-body-size", type=size, default=4 << 20, metavar="SIZE",
                   help="largest request body accepted (413 above it)")
    p.add_argument("--max-connections", type=positive_int, default=1024, metavar="N",
                   help="concurrent client connections at most (503 past it)")
    p.add_argument("--read-timeout", type=positive_float, default=READ_TIMEOUT_S, metavar="SECONDS",
                   help="a client silent this long while sending its request (headers or body) is disconnected, "
                        "so idle connections cannot fill --max-connections; answers are never cut by it")
    p.add_argument("--request-timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="how long a worker may take to answer")
    p.add_argument("--poll-interval", type=positive_float, default=0.5, metavar="SECONDS",
                   help="how often each worker's /kvtier/load is polled")
    p.add_argument("--shutdown-timeout", type=positive_float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM, how long answers in flight may stream on before they are cut")


def run(args: argparse.Namespace) -> int:
    from kvtier.serve.cli import _has, _listen, _need_serve_extra

    _need_serve_extra()
    if not args.decode:
        raise ConfigError("give at least one --decode URL (a decode or a colocated worker)")
    seen = args.prefill + args.decode
    dup = sorted({u for u in seen if seen.count(u) > 1})
    if dup:
        raise ConfigError(f"{dup[0]} is listed twice; a worker is either --prefill or --decode, once")
    sock = _listen(args.host, args.port)
    try:
        return _serve(args, sock, _has)
    finally:
        sock.close()


class _QuietCut(logging.Filter):
    """Once the router is stopping, uvicorn's report of the answers it cuts at --shutdown-timeout
    (one ERROR line, then a CancelledError traceback per answer: "Exception in ASGI application")
    becomes one line of ours: the cut is the documented stop, not an error."""

    def __init__(self, server: Any) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.server.should_exit:
            return True
        if record.getMessage().startswith("Cancel ") and "graceful shutdown exceeded" in record.getMessage():
            say(f"kvtier router: cutting {record.args[0] if record.args else 'the'} answer(s) still running after "
                "--shutdown-timeout")
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, asyncio.CancelledError)


def _serve(args: argparse.Namespace, sock: Any, has: Any) -> int:
    import signal

    import uvicorn

    from kvtier.router.app import Router, RouterConfig, build_app
    from kvtier.router.workers import Pools, Worker
    from kvtier.serve.cli import _QuietSignals
    from kvtier.serve.http import uvicorn_config

    pools = Pools([Worker(u, "prefill") for u in args.prefill], [Worker(u, "decode") for u in args.decode],
                  announce=lambda what: say(f"kvtier router: {what}"))
    router = Router(pools, RouterConfig(policy=args.policy, direct_below=args.direct_below,
                                        max_body_bytes=args.max_body_size, request_timeout=args.request_timeout,
                                        poll_interval=args.poll_interval, handoff=args.handoff,
                                        prefixes=args.prefixes))
    config = uvicorn_config(build_app(router), max_connections=args.max_connections,
                            shutdown_timeout=args.shutdown_timeout, read_timeout=args.read_timeout)
    # SIGTERM/SIGINT stop it the way uvicorn stops, then it exits 0 (uvicorn's own handler
    # would re-raise the signal at the end: an exit "by signal" for a clean stop)
    server = type("RouterUvicorn", (_QuietSignals, uvicorn.Server), {})(config)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"

    logging.getLogger("uvicorn.error").addFilter(_QuietCut(server))

    async def main() -> None:
        def on_signal() -> None:
            server.force_exit = server.should_exit     # a second signal: stop waiting for answers in flight
            server.should_exit = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, on_signal)
        await router.start(max_connections=args.max_connections)
        say(f"kvtier router: listening on {url} ({len(args.prefill)} prefill, {len(args.decode)} decode workers, "
            f"policy {args.policy}, {args.handoff} hand-over; GET {url}/health lists them)")
        try:
            await server.serve(sockets=[sock])
        finally:
            await router.stop()

    if has("uvloop"):
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
    say("kvtier router: stopped")
    return 0
