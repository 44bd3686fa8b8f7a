"""`kvtier bench serve`: a load test of `kvtier serve` with a generated agentic trace.

The server runs in its own process on loopback, with small device and host caches so the
trace does not fit (memory pressure). Sessions run as agents do: --active sessions are in
flight at once, each plays its turns in order and waits --think seconds between two turns
(the agent's tool call), and at most --clients requests stream at a time (the official
openai client, async); the run is bounded in requests and in time. While one session
waits, the others' turns fill the cache, which is what a pin is for. Each mode runs on a
fresh server (a cold cache): without x-session-affinity, then with it (the session's
prefix pinned for --pin-ttl seconds after each turn). With --servers 2, --route says how
requests reach them: a session's turns to one server (affinity routing), each request to
the next server (none), or through `kvtier router`. Reported per mode: throughput, TTFT
and inter-token latency percentiles as the client sees them, the prompt-cache hit ratio
(from usage.prompt_tokens_details) and where cached tokens came from, and whether every
request got exactly one complete answer.

The trace's prompts are thinned to every --stride-th token (a prompt that extends another
still extends it) and mapped into the byte-level vocabulary, so that they fit the tiny
model's context and a CPU's speed while keeping the agentic sharing pattern.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvtier.bench.children import Children

if TYPE_CHECKING:
    from kvtier.bench.common import Column

HELP = "load test of `kvtier serve`: concurrent streaming agent sessions, with and without x-session-affinity"
MODES = ("none", "affinity")
# How requests reach two servers: a session's turns to one server (session i to server i mod
# 2: affinity routing), each request to the next server in turn (no affinity), or through
# `kvtier router` (its cache-aware rule, from the servers' KV events).
ROUTES = ("session", "request", "router")
ERROR = "kvtier: error: "     # how a kvtier process says what went wrong, on one line


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_float, positive_int
    from kvtier.bench.common import choice_list

    add_workload_arguments(p)
    p.add_argument("--pin-ttl", type=positive_float, default=30.0, metavar="SECONDS",
                   help="the server's pin TTL for x-session-affinity sessions (default: 30)")
    p.add_argument("--modes", type=choice_list(MODES), default=list(MODES), metavar="LIST",
                   help="none (no affinity header), affinity (one per session), comma-separated")
    p.add_argument("--servers", type=positive_int, default=1, choices=[1, 2], metavar="N",
                   help="1, or 2 servers sharing blocks over kvtier node links, sessions split between them "
                        "(default: 1)")
    p.add_argument("--route", type=choice_list(ROUTES), default=["session"], metavar="LIST",
                   help="--servers 2: how requests reach them: session (a session's turns to one server), "
                        "request (each request to the next server: no affinity), router (through `kvtier "
                        "router`), comma-separated (default: session)")
    p.add_argument("--no-links", action="store_true",
                   help="--servers 2: no node links between them (each server has only its own cache)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The agents' workload and the servers' cache: what `bench serve` and `bench disagg` share."""
    from kvtier.argtypes import non_negative_float, non_negative_int, positive_float, positive_int, size

    p.add_argument("--clients", type=positive_int, default=4, metavar="N",
                   help="requests streaming at once at most (default: 4)")
    p.add_argument("--active", type=positive_int, default=12, metavar="N",
                   help="sessions in flight at once, each waiting --think between its turns (default: 12)")
    p.add_argument("--think", type=non_negative_float, default=1.0, metavar="SECONDS",
                   help="pause between two turns of a session: the agent's tool call (default: 1.0)")
    p.add_argument("--sessions", type=positive_int, default=24, metavar="N", help="sessions in the generated trace")
    p.add_argument("--max-requests", type=positive_int, default=80, metavar="N", help="requests per mode: the first sessions' turns, up to this many")
    p.add_argument("--duration", type=positive_float, default=120.0, metavar="SECONDS",
                   help="stop starting requests after this long, per mode (those not started count as lost)")
    p.add_argument("--max-tokens", type=positive_int, default=16, metavar="N", help="tokens generated per request")
    p.add_argument("--stride", type=positive_int, default=16, metavar="N",
                   help="keep every N-th token of the trace's prompts (fits the tiny model and a CPU)")
    p.add_argument("--max-prompt", type=positive_int, default=2048, metavar="TOKENS",
                   help="sessions end before a prompt longer than this (after thinning)")
    p.add_argument("--kv-cache", type=size, default=6 << 20, metavar="SIZE", help="the server's device tier")
    p.add_argument("--host-cache", type=size, default=8 << 20, metavar="SIZE", help="the server's host tier")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the generated trace")
    p.add_argument("--model", default="kimi-tiny", metavar="PRESET_OR_DIR", help="the served model")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")


@dataclass
class Turn:
    session: str
    index: int
    prompt: list[int]


@dataclass
class Result:
    session: str
    index: int
    ok: bool = False
    error: str = ""
    response_id: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)


def sessions_of(args: argparse.Namespace) -> list[list[Turn]]:
    """The trace as sessions of turns, thinned and mapped to byte-level token ids."""
    from kvtier.traces.synthetic import AgenticConfig, generate

    cfg = AgenticConfig(seed=args.seed, sessions=args.sessions, max_context=args.max_prompt * args.stride)
    by_session: dict[str, list[Turn]] = {}
    for r in generate(cfg):
        ids = [int(t) % 256 for t in r.tokens[::args.stride]]
        turns = by_session.setdefault(r.session, [])
        turns.append(Turn(r.session, len(turns), ids))
    chosen, total = [], 0        # the first sessions, up to --max-requests turns: every mode replays the same set
    for turns in by_session.values():
        if total >= args.max_requests:
            break
        chosen.append(turns[:args.max_requests - total])
        total += len(chosen[-1])
    return chosen


class KvtierProcess:
    """A `kvtier` command (serve, router) in a subprocess on loopback, owned by `children`;
    `url` is taken from its first line that starts with `ready` (e.g. "kvtier serve: ready:
    'm' on http://..."). It runs this kvtier (common.child_env), on one torch thread."""

    def __init__(self, children: Children, cmd: list[str], ready: str = "kvtier serve: ready:") -> None:
        from kvtier.bench.common import child_env
        self.proc = children.start([sys.executable, "-m", "kvtier.cli", *cmd], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=child_env(OMP_NUM_THREADS="1"))
        self.lines: list[str] = []
        self.url = ""
        got = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith(ready) and not self.url:
                    self.url = line.split(" on ", 1)[1].split()[0]
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(300) or not self.url:
            from kvtier.errors import ConfigError, KvtierError
            try:
                code = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None             # still running: `children` stops it
            said = [ln[len(ERROR):] for ln in self.lines if ln.startswith(ERROR)]
            if said:       # the server's own one-line error, as a usage error when it was one
                raise (ConfigError if code == 2 else KvtierError)(f"kvtier {cmd[0]}: {said[-1]}")
            raise KvtierError(f"kvtier {cmd[0]} did not start: " + " | ".join(self.lines[-5:]))


def serve_process(children: Children, args: argparse.Namespace, extra: list[str] | None = None) -> KvtierProcess:
    """`kvtier serve` on a free loopback port with the benchmark's model, caches and pin TTL."""
    return KvtierProcess(children, ["serve", "--host", "127.0.0.1", "--port", "0", "--model", args.model, "--kv-cache",
                          str(args.kv_cache), "--host-cache", str(args.host_cache), "--pin-ttl", str(args.pin_ttl),
                          *(extra or [])])


async def _one(client: Any, model: str, turn: Turn, max_tokens: int, affinity: bool) -> Result:
    res = Result(turn.session, turn.index)
    headers = {"x-session-affinity": turn.session} if affinity else {}
    t0 = last = time.perf_counter()
    done = False
    try:
        stream = await client.completions.create(
            model=model, prompt=turn.prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, extra_headers=headers)
        async for chunk in stream:
            now = time.perf_counter()
            res.response_id = res.response_id or chunk.id
            if chunk.id != res.response_id:
                res.error = "chunks of two responses in one stream"
            for ch in chunk.choices:
                if ch.text:
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.gaps.append(now - last)
                    last = now
                if ch.finish_reason:
                    done = True
            if chunk.usage is not None:
                u = chunk.usage
                res.prompt_tokens, res.completion_tokens = u.prompt_tokens, u.completion_tokens
                d = u.prompt_tokens_details
                res.cached_tokens = d.cached_tokens if d is not None else 0
                res.by_tier = dict((d.model_extra or {}).get("kvtier_cached_by_tier", {})) if d is not None else {}
    except Exception as e:      # noqa: BLE001 - counted as a lost request
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.ok = done and res.completion_tokens == max_tokens and not res.error
    if not res.ok and not res.error:
        res.error = f"incomplete: finish={done}, {res.completion_tokens} of {max_tokens} tokens"
    return res


async def _replay(urls: list[str], model: str, sessions: list[list[Turn]], args: argparse.Namespace,
                  affinity: bool, by_request: bool = False) -> tuple[list[Result], float, int]:
    """--active sessions at a time, each turn after turn with --think between them, at most
    --clients requests at once; (results, seconds, requests planned). Session i is served by
    server i % len(urls), or with `by_request` each request by the next server in turn."""
    import itertools

    import openai

    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=300) for u in urls]
    queue = list(enumerate(sessions))
    turn_by_turn = itertools.cycle(clients)
    results: list[Result] = []
    streams = asyncio.Semaphore(args.clients)
    t0 = time.perf_counter()

    async def agent() -> None:
        while queue:
            i, turns = queue.pop(0)
            for k, turn in enumerate(turns):
                if k:
                    await asyncio.sleep(args.think)
                if time.perf_counter() - t0 > args.duration:
                    return
                client = next(turn_by_turn) if by_request else clients[i % len(clients)]
                async with streams:
                    results.append(await _one(client, model, turn, args.max_tokens, affinity))

    await asyncio.gather(*(agent() for _ in range(args.active)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return results, wall, sum(len(s) for s in sessions)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1000


def summarize(mode: str, results: list[Result], wall: float, started: int, exit_code: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    keys = [(r.session, r.index) for r in results]
    ids = [r.response_id for r in results if r.response_id]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tiers: dict[str, int] = {}
    for r in ok:
        for t, n in r.by_tier.items():
            tiers[t] = tiers.get(t, 0) + n
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    out_tokens = sum(r.completion_tokens for r in ok)
    row: dict[str, Any] = {
        "bench": "serve", "mode": mode, "requests": started, "completed": len(ok),
        "lost": started - len(ok), "duplicates": (len(keys) - len(set(keys))) + (len(ids) - len(set(ids))),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "wall_s": round(wall, 2), "req_per_s": round(len(ok) / wall, 3), "out_tok_per_s": round(out_tokens / wall, 1),
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "server_exit": exit_code,
    }
    for t in ("device", "host", "disk", "remote"):
        row[f"cached_{t}"] = tiers.get(t, 0)
    for name, values in (("ttft", ttft), ("itl", gaps)):
        for q in (50, 90, 99):
            v = _pct(values, q)
            row[f"{name}_p{q}_ms"] = None if v is None else round(v, 1)
    return row


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import emit
    from kvtier.errors import ConfigError
    from kvtier.progress import progress

    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("kvtier bench serve needs the openai client: pip install openai") from None
    if args.servers == 1 and (args.route != ["session"] or args.no_links):
        raise ConfigError("--route and --no-links are for --servers 2 (one server serves every request)")
    sessions = sessions_of(args)
    if not sessions:
        raise ConfigError("the generated trace has no request that fits --max-prompt: raise it or lower --stride")
    rows = []
    with Children() as children:            # Ctrl-C, SIGTERM or an error: no server outlives the bench
        for route in args.route:
            for mode in args.modes:
                what = f"{mode}" + (f", route {route}" if args.servers > 1 else "")
                with progress(f"{what}: starting kvtier serve, replaying {args.sessions} sessions",
                              enabled=not args.json):
                    procs = _start_servers(children, args)
                    urls = [x.url for x in procs]
                    if route == "router":
                        procs.append(router_process(children, urls))
                        urls = [procs[-1].url]
                    results, wall, started = asyncio.run(_replay(urls, _served(args.model), sessions, args,
                                                                 mode == "affinity", by_request=route == "request"))
                    code = children.stop([x.proc for x in procs], grace=120)     # each drains
                rows.append({**summarize(mode, results, wall, started, code), "servers": args.servers,
                             "route": route if args.servers > 1 else None,
                             "links": args.servers > 1 and not args.no_links})
    links = "" if args.servers == 1 else " (no node links)" if args.no_links else " (node links)"
    emit(rows, args.json, f"kvtier serve x{args.servers}{links}, {args.active} agents (think {args.think:g} s), {args.clients} streams "
                          f"at most, {args.max_tokens} tokens each "
                          f"(kv {args.kv_cache >> 20} MiB, host {args.host_cache >> 20} MiB)",
         table_columns(args.servers), left=1)
    bad = [r for r in rows if r["lost"] or r["duplicates"] or r["server_exit"] != 0]
    for r in bad:       # why the run failed, where the table (its counts only) does not say
        what = f"{r['mode']}" + (f", route {r['route']}" if r["route"] else "")
        why = [f"{r['lost']} of {r['requests']} requests failed" + (f" ({r['errors'][0]})" if r["errors"] else "")
               if r["lost"] else "", f"{r['duplicates']} answered twice" if r["duplicates"] else "",
               f"a server exited with {r['server_exit']}" if r["server_exit"] != 0 else ""]
        print(f"kvtier bench serve: {what}: " + "; ".join(w for w in why if w), file=sys.stderr)
    return 1 if bad else 0


def table_columns(servers: int) -> list[Column]:
    """`bench serve`'s table: the route (two servers), the affinity mode, then run_columns()."""
    from kvtier.bench.common import Column
    return [*([Column("route", "route")] if servers > 1 else []), Column("mode", "affinity"), *run_columns()]


def run_columns() -> list[Column]:
    """A replay's columns for a table: answers (done/lost/dup), tokens/s, TTFT and ITL
    p50/p90/p99 in one cell each (a column each was past a pipe's 100 characters), hit
    ratio; req/s and cached-by-tier are left to --json."""
    from kvtier.bench.common import Column, fmt_float

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"

    def percentiles(what: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: "/".join(ms(r[f"{what}_{p}_ms"]) for p in ("p50", "p90", "p99"))
    return [Column("completed", "done/lost/dup", of_row=lambda r: f"{r['completed']}/{r['lost']}/{r['duplicates']}"),
            Column("out_tok_per_s", "tok/s", fmt_float(1)),
            Column("ttft_p50_ms", "TTFT p50/90/99", of_row=percentiles("ttft")),
            Column("itl_p50_ms", "ITL p50/90/99", of_row=percentiles("itl")), Column("hit_ratio", "hit", fmt_float(3))]


def _start_servers(children: Children, args: argparse.Namespace) -> list[KvtierProcess]:
    """One server, or two whose stores fetch each other's blocks over kvtier node links
    (--no-links: two that do not)."""
    if args.servers == 1:
        return [serve_process(children, args)]
    if args.no_links:
        return [serve_process(children, args) for _ in range(2)]
    import socket
    import tempfile

    ports = []
    for _ in range(2):                      # two free loopback ports for the nodes
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    secret = tempfile.NamedTemporaryFile(prefix="kvtier-bench-secret-", delete=False)
    secret.write(os.urandom(32))
    secret.close()
    try:
        return [serve_process(children, args, ["--node-listen", f"127.0.0.1:{ports[me]}", "--peers",
                                               f"127.0.0.1:{ports[peer]}", "--secret-file", secret.name])
                for me, peer in ((0, 1), (1, 0))]
    finally:
        os.unlink(secret.name)              # read at start-up


def router_process(children: Children, decode: list[str], *flags: str) -> KvtierProcess:
    """`kvtier router` over workers (--decode, and any --prefill in `flags`), once it has
    polled them all ready and learned their tokenizers (so its first routes are informed)."""
    import httpx

    from kvtier.errors import KvtierError

    router = KvtierProcess(children, ["router", "--port", "0", "--poll-interval", "0.2", *flags,
                                      *(a for u in decode for a in ("--decode", u))], "kvtier router: listening on")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = httpx.get(router.url + "/health", timeout=10).json()
        if h["status"] == "ready" and h.get("calibrated") and all(w["status"] == "ready" for w in h["workers"]):
            return router
        time.sleep(0.2)
    raise KvtierError(f"the router's workers did not become ready: {h}")


def _served(model: str) -> str:
    from pathlib import Path

    from kvtier.engine.config import preset_names
    return model if model in preset_names() else Path(model).resolve().name
