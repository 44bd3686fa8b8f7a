"""A discrete-event model of colocated vs disaggregated serving: what chunked prefill
sharing a step with decodes does to inter-token latency, and what moving prefill to its
own workers (plus a KV transfer) does to TTFT and ITL.

Each worker runs steps. A colocated worker's step carries every running decode (one token
each) and up to `chunk` prompt tokens of the oldest waiting prefill; it lasts
`decode_base_s + decode_per_seq_s * decodes + prefill_per_token_s * chunk tokens`, so a
step that carries a chunk stretches every decode's gap: that is the ITL tail. A prefill
worker runs only chunks; a finished prompt's KV then travels for `tokens * kv_bytes_per_token
/ link_bytes_per_s` and joins a decode worker, whose steps carry only decodes. Requests
arrive as a Poisson process and go to the worker with the least work, counted in tokens
(`placement="tokens"`: the prompt tokens it has still to prefill, and its decodes), or to
the next worker in turn (`"round-robin"`); a finished prefill's KV goes to the decode
worker running the fewest sequences, or to the next in turn. Prompts are all
`prompt_tokens` long, or vary around it (`prompt_spread`, a lognormal's sigma) as agents'
prompts do.

Costs are inputs: measured on this machine by the reference engine (kvtier/sim/calibrate.py) or set
to GPU-scale figures (`GPU_KIMI_K2`, derived in docs/disaggregation.md) to predict the
effect where the production report measured it (p90 time per token ~100 ms colocated,
20-30 ms disaggregated).
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Callable

from kvtier.errors import ConfigError


@dataclass
class Costs:
    prefill_per_token_s: float          # compute of one prompt token inside a chunk
    decode_base_s: float                # a decode step's fixed cost (weights read once per step)
    decode_per_seq_s: float             # each running sequence's share of a step
    kv_bytes_per_token: int = 70_272    # Kimi K2, bf16 MLA
    link_bytes_per_s: float = 50e9      # prefill -> decode link
    chunk: int = 2048                   # prompt tokens per step at most (chunked prefill)


@dataclass
class Workload:
    rate: float                          # requests per second, whole cluster
    prompt_tokens: int                   # uncached prompt tokens per request
    output_tokens: int
    requests: int = 400
    seed: int = 0
    prompt_spread: float = 0.0           # 0: every prompt prompt_tokens long; else lognormal (sigma), same mean


# GPU-scale costs for Kimi K2 on one 8 x H100-class node (derivation in docs/disaggregation.md):
# 32B active parameters -> ~64 GFLOP per prompt token at ~40 % of ~8 PFLOP/s FP8 -> 20 us/token;
# a decode step reads the active experts' weights and the batch's KV: ~18 ms base, +0.1 ms/seq.
GPU_KIMI_K2 = Costs(prefill_per_token_s=20e-6, decode_base_s=0.018, decode_per_seq_s=0.0001, chunk=4096)


@dataclass
class _Req:
    arrival: float
    prompt: int
    left: int                            # prompt tokens not computed yet
    out: int = 0
    last: float | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)


@dataclass
class _Worker:
    waiting: list[_Req] = field(default_factory=list)    # prefills, oldest first
    running: list[_Req] = field(default_factory=list)    # decodes
    free_at: float = 0.0
    busy: bool = False

    def work(self) -> int:
        return sum(r.left for r in self.waiting) + len(self.running) * 64


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


PLACEMENTS = ("tokens", "round-robin")


def simulate(costs: Costs, load: Workload, prefill_workers: int, decode_workers: int,
             colocated: bool = False, placement: str = "tokens") -> dict:
    """Colocated: `decode_workers` workers doing both (prefill_workers ignored). Returns TTFT
    and ITL percentiles (ms) and output tokens per second."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}")
    rng = random.Random(load.seed)
    sigma = load.prompt_spread
    t, arrivals = 0.0, []
    for _ in range(load.requests):
        t += rng.expovariate(load.rate)
        n = load.prompt_tokens if not sigma else max(1, round(load.prompt_tokens *
                                                              rng.lognormvariate(-sigma * sigma / 2, sigma)))
        arrivals.append(_Req(t, n, n))
    turns = {"prefill": 0, "decode": 0}

    def place(pool: list[_Worker], kind: str, load_of: Callable[[_Worker], int]) -> _Worker:
        if placement == "tokens":
            return min(pool, key=load_of)
        turns[kind] += 1
        return pool[(turns[kind] - 1) % len(pool)]
    P = [] if colocated else [_Worker() for _ in range(prefill_workers)]
    D = [_Worker() for _ in range(decode_workers)]
    events: list[tuple[float, int, str, object]] = []   # (time, seq, kind, payload)
    seq = 0

    def push(when: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (when, seq, kind, payload))

    for r in arrivals:
        push(r.arrival, "arrive", r)
    done: list[_Req] = []
    end = 0.0

    def kick(w: _Worker, now: float, decode_only: bool) -> None:
        if w.busy or not (w.waiting or w.running):
            return
        dur, chunk_of = 0.0, []
        if w.running:
            dur += costs.decode_base_s + costs.decode_per_seq_s * len(w.running)
        budget = costs.chunk
        for r in w.waiting:
            if budget <= 0:
                break
            n = min(r.left, budget)
            chunk_of.append((r, n))
            budget -= n
        if chunk_of:
            dur += costs.prefill_per_token_s * sum(n for _, n in chunk_of)
            if not w.running:
                dur += costs.decode_base_s          # a step's fixed cost is paid once either way
        w.busy = True
        push(now + dur, "step", (w, list(w.running), chunk_of, decode_only))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        end = now
        if kind == "arrive":
            r = payload
            pool = D if colocated else P
            w = place(pool, "prefill", _Worker.work)
            w.waiting.append(r)                      # type: ignore[arg-type]
            kick(w, now, False)
        elif kind == "kv":
            r = payload
            w = place(D, "decode", lambda x: len(x.running))
            r.last = None                            # type: ignore[union-attr]
            w.running.append(r)                      # type: ignore[arg-type]
            kick(w, now, True)
        else:
            w, decs, chunk_of, _ = payload           # type: ignore[misc]
            w.busy = False
            for r in decs:
                r.out += 1
                if r.ttft is None:
                    r.ttft = now - r.arrival
                else:
                    r.gaps.append(now - r.last)
                r.last = now
                if r.out >= load.output_tokens:
                    w.running.remove(r)
                    done.append(r)
            for r, n in chunk_of:
                r.left -= n
                if r.left == 0:
                    w.waiting.remove(r)
                    if colocated:
                        r.out, r.ttft, r.last = 1, now - r.arrival, now       # the prefill's step samples
                        w.running.append(r)
                    else:                                                     # hand the KV over
                        push(now + r.prompt * costs.kv_bytes_per_token / costs.link_bytes_per_s, "kv", r)
            kick(w, now, not colocated and w in D)
    ttft = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    return {"setup": "colocated" if colocated else f"{prefill_workers}P+{decode_workers}D",
            "requests": len(done), "out_tok_per_s": round(sum(r.out for r in done) / end, 1) if end else 0.0,
            **{f"ttft_p{q}_ms": round(_pct(ttft, q) * 1e3, 1) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": round(_pct(gaps, q) * 1e3, 1) for q in (50, 90, 99)}}


def compare(costs: Costs, load: Workload, workers: int = 2, placement: str = "tokens") -> list[dict]:
    """`workers` colocated workers vs the same count split into prefill and decode halves."""
    p = max(1, workers // 2)
    return [simulate(costs, load, 0, workers, colocated=True, placement=placement),
            simulate(costs, load, p, workers - p, placement=placement)]
