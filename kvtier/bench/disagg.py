"""`kvtier bench disagg`: 1 router + 1 prefill + 1 decode worker vs 2 colocated (`both`)
workers behind the same router, on loopback, replaying the same input-heavy agentic trace
(kvtier/bench/serve.py's sessions: streaming clients, each playing whole sessions).

Reported per setup: TTFT and inter-token latency p50/p90/p99 as the client sees them,
throughput, the hit ratio, and the KV bytes handed over with the time that took (GB/s):
with `--handoff pull` the decode worker's HAS + GET from the prefill worker's node, with
`--handoff push` the prefill worker's HAS + PUTs to the decode worker's node (`pull,push`
runs the P/D setup once each). Bounded in requests and in time; every process it starts is
stopped (SIGTERM, then killed), whatever ends the run (Ctrl-C and SIGTERM too).

`--predict` runs no servers: it times the engine's prefill and decode steps here
(kvtier/sim/calibrate.py) and prints the disaggregation model's predictions (kvtier/sim/disagg.py)
with those costs, each worker on cores of its own, and with GPU-scale costs (GPU_KIMI_K2).
"""
from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.bench.children import Children
    from kvtier.bench.common import Column
    from kvtier.bench.serve import KvtierProcess

HELP = "prefill/decode disaggregation vs colocated workers behind `kvtier router`, on loopback"
SETUPS = ("pd", "colocated")
HANDOFFS = ("pull", "push")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import non_negative_int
    from kvtier.bench.common import choice_list
    from kvtier.bench.serve import add_workload_arguments

    add_workload_arguments(p)
    p.set_defaults(max_requests=32, sessions=12, clients=4, duration=240.0)
    p.add_argument("--setups", type=choice_list(SETUPS), default=list(SETUPS), metavar="LIST",
                   help="pd (router + prefill + decode), colocated (router + 2 both workers), comma-separated")
    p.add_argument("--handoff", type=choice_list(HANDOFFS), default=["pull"], metavar="LIST",
                   help="the pd setup's hand-over (`kvtier router --handoff`): pull, push, or pull,push (one run each)")
    p.add_argument("--direct-below", type=non_negative_int, default=256, metavar="TOKENS",
                   help="the router's --direct-below: 0 hands every prompt over")
    p.add_argument("--predict", action="store_true",
                   help="instead: time the engine's prefill and decode steps here and print the disaggregation "
                        "model's predictions with those costs and with GPU-scale ones (no servers)")


def _cluster(children: Children, setup: str, handoff: str,
             args: argparse.Namespace) -> tuple[list[KvtierProcess], str, list[str]]:
    """The setup's workers and the router over them, started and ready (`children` owns them)."""
    from kvtier.bench.serve import KvtierProcess, router_process

    serve = ["serve", "--host", "127.0.0.1", "--port", "0", "--model", args.model, "--kv-cache", str(args.kv_cache),
             "--host-cache", str(args.host_cache)]
    roles = ("prefill", "decode") if setup == "pd" else ("both", "both")
    procs = [KvtierProcess(children, serve + ["--role", role]) for role in roles]
    urls = [x.url for x in procs]
    flags = ["--handoff", handoff, "--direct-below", str(args.direct_below)]
    if setup == "pd":
        procs.append(router_process(children, urls[1:], "--prefill", urls[0], *flags))
    else:
        procs.append(router_process(children, urls, *flags))
    return procs, procs[-1].url, urls


def _moved(urls: list[str]) -> dict[str, Any]:
    """KV handed over, from the workers' /kvtier/load: pulled by decode workers, pushed by prefill ones."""
    import httpx
    blocks = nbytes = 0
    seconds = 0.0
    for u in urls:
        d = httpx.get(u + "/kvtier/load", timeout=10).json()
        blocks += d.get("pulled_blocks", 0) + d.get("pushed_blocks", 0)
        nbytes += d.get("pulled_bytes", 0) + d.get("pushed_bytes", 0)
        seconds += d.get("pull_seconds", 0.0) + d.get("push_seconds", 0.0)
    return {"moved_blocks": blocks, "moved_bytes": nbytes, "move_s": round(seconds, 4),
            "move_gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds else None}


def run(args: argparse.Namespace) -> int:
    if args.predict:
        return _predict(args)
    import httpx

    from kvtier.bench.common import emit
    from kvtier.bench.children import Children
    from kvtier.bench.serve import _replay, _served, sessions_of, summarize
    from kvtier.progress import progress

    sessions = sessions_of(args)
    rows = []
    runs = [(setup, h) for setup in args.setups for h in (args.handoff if setup == "pd" else ["pull"])]
    with Children() as children:            # Ctrl-C, SIGTERM or an error: no process outlives the bench
        for setup, handoff in runs:
            name = f"pd-{handoff}" if setup == "pd" else setup
            with progress(f"{name}: starting workers and the router, replaying", enabled=not args.json):
                procs, router, urls = _cluster(children, setup, handoff, args)
                results, wall, started = asyncio.run(_replay([router], _served(args.model), sessions, args, False))
                moved = _moved(urls)
                stats = httpx.get(router + "/health", timeout=10).json()["stats"]
                code = children.stop([x.proc for x in procs], grace=120)      # each drains
            row = summarize(setup, results, wall, started, code)
            row.update(bench="disagg", setup=row.pop("mode"), handoff=handoff if setup == "pd" else None, **moved,
                       disaggregated=stats["disaggregated"], direct=stats["direct"])
            rows.append(row)
    emit(rows, args.json, f"router + workers on loopback, {args.clients} streaming clients, {args.max_tokens} tokens "
         "each (times in ms)", columns(), left=1)
    return 1 if any(r["lost"] or r["duplicates"] for r in rows) else 0


def columns() -> list[Column]:
    """The table's columns (--json has every field apart)."""
    from kvtier.bench.common import Column, fmt_float, fmt_size
    from kvtier.bench.serve import run_columns
    done, tok, ttft, itl, hit = run_columns()
    return [Column("setup", "setup", of_row=lambda r: r["setup"] + (f"-{r['handoff']}" if r.get("handoff") else "")),
            done, tok, ttft, itl, hit, Column("moved_bytes", "KV moved", fmt_size), Column("move_gb_per_s", "GB/s", fmt_float(3))]


def _predict(args: argparse.Namespace) -> int:
    """The model (kvtier/sim/disagg.py) on costs measured here and on GPU-scale costs."""
    import json

    from kvtier.bench.common import Column, emit, fmt_float
    from kvtier.progress import progress
    from kvtier.sim.calibrate import measure_costs
    from kvtier.sim.disagg import GPU_KIMI_K2, Workload, compare

    with progress("timing the engine's prefill and decode steps", enabled=not args.json):
        m = measure_costs(args.model)
    c = m.costs
    costs = {"bench": "disagg", "costs": "measured here", "prefill_us_per_token": round(c.prefill_per_token_s * 1e6, 1),
             "decode_step_ms": round(c.decode_base_s * 1e3, 2), "decode_ms_per_seq": round(c.decode_per_seq_s * 1e3, 3),
             "kv_bytes_per_token": c.kv_bytes_per_token, "chunk": c.chunk, "timed_steps_s": m.step_s}
    if args.json:
        print(json.dumps(costs), flush=True)
    else:
        print(f"measured here ({args.model}, one thread): prefill {costs['prefill_us_per_token']} us/token, "
              f"decode step {costs['decode_step_ms']} ms + {costs['decode_ms_per_seq']} ms per sequence, "
              f"KV {c.kv_bytes_per_token} B/token")
    # Here: 2,048-token prompts at 30 % and 60 % of two workers' prefill capacity. GPU: the
    # documented Kimi K2 case (docs/disaggregation.md).
    prompt, out = 2048, 64
    cases = [(c, "measured here", Workload(util * 2 / (prompt * c.prefill_per_token_s), prompt, out, requests=200))
             for util in (0.3, 0.6)] if c.prefill_per_token_s > 0 else []
    cases += [(GPU_KIMI_K2, "GPU_KIMI_K2", Workload(rate, 8000, 200, requests=300)) for rate in (2.0, 4.0)]
    rows = []
    for cost, name, load in cases:
        for r in compare(cost, load, workers=2):
            rows.append({"bench": "disagg", "costs": name, "rate": round(load.rate, 3), "prompt_tokens": load.prompt_tokens,
                         "output_tokens": load.output_tokens, **r})
    f1 = fmt_float(1)
    emit(rows, args.json, "the disaggregation model, 2 workers (kvtier/sim/disagg.py)",
         [Column("costs", "costs"), Column("setup", "setup"), Column("rate", "req/s", fmt_float(2)),
          Column("ttft_p50_ms", "TTFT p50", f1), Column("ttft_p90_ms", "p90", f1), Column("itl_p50_ms", "ITL p50", f1),
          Column("itl_p90_ms", "p90", f1), Column("itl_p99_ms", "p99", f1), Column("out_tok_per_s", "tok/s", f1)],
         left=2)
    return 0
