"""`kvtier bench engine --speculative JSON`: decode tokens/s and mean acceptance length with
speculative decoding vs the same engine without it, in the same run, on tool-call-like
prompts (JSON calls that repeat names from the prompt, the text prompt lookup is for) and on
free prose.

Both engines are built first and their timed runs alternate (off, on, on, off, ...), so
load on a shared machine falls on both alike; tokens/s are medians over --repeat runs.
With a preset's random weights the output never copies the prompt, so n-gram acceptance
comes only from repetition the model falls into by chance (the figures show speculation's
cost, not its gain), and a draft model is only meaningful as the target itself (an upper
bound on acceptance that checks the machinery). A real checkpoint is needed for the gain.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

TOOLS = ("get_weather", "search_flights", "book_hotel", "send_email", "create_calendar_event",
         "lookup_customer", "refund_order", "translate_text")

SENTENCES = ("The river ran high after the spring rains, and the ferry waited on the far bank.",
             "Nobody in the village remembered who had planted the orchard on the hill.",
             "She read the letter twice before folding it into the pocket of her coat.",
             "By noon the market square was loud with carts, gulls and arguing traders.",
             "The old clock in the station had been five minutes slow for thirty years.",
             "He promised himself that this winter he would finally learn to sail.",
             "Rain tapped at the window while the kettle began, slowly, to sing.",
             "The map was wrong about the bridge, but right about almost everything else.")


def tool_prompt(i: int) -> str:
    """A system prompt listing tools and a few earlier calls, then the start of a new call."""
    tools = "\n".join(f'{{"name": "{t}", "parameters": {{"type": "object", "properties": '
                      f'{{"id": {{"type": "string"}}, "query": {{"type": "string"}}}}}}}}' for t in TOOLS)
    calls = "\n".join(json.dumps({"name": TOOLS[(i + j) % len(TOOLS)], "arguments": {"id": f"c{i}-{j}", "query": "x"}})
                      for j in range(3))
    return f"Tools:\n{tools}\nEarlier calls:\n{calls}\nNext call:\n{{\"name\": \"{TOOLS[i % len(TOOLS)]}\", "


def text_prompt(i: int) -> str:
    """Free prose: the sentences in an order that depends on i, then the start of a new one."""
    n = len(SENTENCES)
    return " ".join(SENTENCES[(i * 3 + j * 5) % n] for j in range(n)) + " Later that evening,"


PROMPTS = {"tool": tool_prompt, "text": text_prompt}


def run(args: argparse.Namespace, spec_json: str) -> int:
    from kvtier import StoreConfig
    from kvtier.bench.common import Column, emit, fmt_float, quiet_threads
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
            prompt = PROMPTS[kind]
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
