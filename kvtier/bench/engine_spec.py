"""`kvtier bench engine --speculative JSON`: decode tokens/s and mean acceptance length with
speculative decoding vs the same engine without it, in the same run, on an agent's tool-call
prompts (a tool list, a request, then the assistant's first call: JSON that copies names and
values from the prompt) and on free prose (kvtier/bench/spec_text.py).

Both engines are built first and their timed runs alternate (off, on, on, off, ...), so
load on a shared machine falls on both alike; tokens/s are medians over --repeat runs.
With a preset's random weights the output never copies the prompt, so n-gram acceptance
comes only from repetition the model falls into by chance (the figures show speculation's
cost, not its gain), and a draft model is only meaningful as the target itself (an upper
bound on acceptance that checks the machinery). The gain needs trained weights:
bench/spec_pair.py trains a target and a draft on the same kinds of text.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time


def run(args: argparse.Namespace, spec_json: str) -> int:
    from kvtier import StoreConfig
    from kvtier.bench.common import Column, emit, fmt_float, quiet_threads
    from kvtier.bench.spec_text import prompt as spec_prompt
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.spec import SpeculativeConfig
    from kvtier.progress import progress

    spec = SpeculativeConfig.from_json(spec_json)
    quiet_threads()
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    kinds = getattr(args, "spec_prompts", ["tool", "text"])
    rows = []
    with progress("engine, speculative", len(kinds) * len(args.batch) * (2 + 2 * args.repeat),
                  enabled=not args.json) as bar:
        for kind in kinds:
            prompt = functools.partial(spec_prompt, kind)
            for b in args.batch:
                engines = {}
                try:
                    for mode, cfg in (("off", None), ("on", spec)):
                        bar.describe(f"{kind}, batch {b}, speculation {mode}: warm-up")
                        cache = StoreConfig(block_tokens=args.block_tokens, host_capacity=None)
                        llm = engines[mode] = LLM(args.preset, dtype=args.dtype, device=args.device, cache=cache,
                                                  speculative=cfg, max_seqs=max(64, b))
                        llm.generate([prompt(1000 + i) for i in range(b)], params)          # warm up
                        llm.spec_stats.__init__()                                            # count timed runs only
                        bar.advance()
                    rates: dict[str, list[float]] = {"off": [], "on": []}
                    tokens = 0
                    for rep in range(args.repeat):
                        for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):   # interleaved
                            bar.describe(f"{kind}, batch {b}, speculation {mode}, run {rep + 1}")
                            t0 = time.perf_counter()
                            outs = engines[mode].generate([prompt(rep * b + i) for i in range(b)], params)
                            wall = time.perf_counter() - t0
                            first = max(o.ttft for o in outs)
                            tokens = sum(len(o.token_ids) - 1 for o in outs)
                            if wall > first:
                                rates[mode].append(tokens / (wall - first))
                            bar.advance()
                    st = engines["on"].stats()["spec"]
                finally:
                    for llm in engines.values():
                        llm.close()
                for mode in ("off", "on"):
                    rows.append({"bench": "engine-spec", "prompts": kind, "batch": b, "speculative":
                                 mode if mode == "off" else f"{spec.method} k={spec.num_speculative_tokens}",
                                 "tokens": tokens, "runs": len(rates[mode]),
                                 "decode_tokens_per_s": round(statistics.median(rates[mode]), 1) if rates[mode] else None,
                                 "mean_acceptance_length": round(st["mean_acceptance_length"], 3) if mode == "on" else None,
                                 "draft_tokens": st["draft_tokens"] if mode == "on" else None,
                                 "accepted_tokens": st["accepted_tokens"] if mode == "on" else None})
    emit(rows, args.json, f"{args.preset}: decode, {args.decode_tokens} tokens per request, medians of "
         f"{args.repeat} interleaved runs; speculative {spec.method} k={spec.num_speculative_tokens} vs none",
         [Column("prompts", "prompts"), Column("batch", "batch"), Column("speculative", "speculative"),
          Column("tokens", "tokens", fmt_float(0)),
          Column("decode_tokens_per_s", "tokens/s", fmt_float(1)),
          Column("mean_acceptance_length", "mean acceptance length", lambda v: "-" if v is None else f"{v:.2f}"),
          Column("draft_tokens", "drafted", lambda v: "-" if v is None else f"{v:,}"),
          Column("accepted_tokens", "accepted", lambda v: "-" if v is None else f"{v:,}")])
    return 0
