"""`kvtier bench engine --speculative JSON`: decode tokens/s and mean acceptance length with
speculative decoding vs the same engine without it, in the same run, on tool-call-like
prompts (JSON calls that repeat names from the prompt, the text prompt lookup is for).

With a preset's random weights the output never copies the prompt, so acceptance comes only
from repetition the model falls into by chance: the figures then show speculation's cost,
not its gain. A real checkpoint is needed for the gain.
"""
from __future__ import annotations

import argparse
import json
import time

TOOLS = ("get_weather", "search_flights", "book_hotel", "send_email", "create_calendar_event",
         "lookup_customer", "refund_order", "translate_text")


def tool_prompt(i: int) -> str:
    """A system prompt listing tools and a few earlier calls, then the start of a new call."""
    tools = "\n".join(f'{{"name": "{t}", "parameters": {{"type": "object", "properties": '
                      f'{{"id": {{"type": "string"}}, "query": {{"type": "string"}}}}}}}}' for t in TOOLS)
    calls = "\n".join(json.dumps({"name": TOOLS[(i + j) % len(TOOLS)], "arguments": {"id": f"c{i}-{j}", "query": "x"}})
                      for j in range(3))
    return f"Tools:\n{tools}\nEarlier calls:\n{calls}\nNext call:\n{{\"name\": \"{TOOLS[i % len(TOOLS)]}\", "


def run(args: argparse.Namespace, spec_json: str) -> int:
    from kvtier import StoreConfig
    from kvtier.bench.common import Column, emit, fmt_float, quiet_threads
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.spec import SpeculativeConfig
    from kvtier.progress import progress

    spec = SpeculativeConfig.from_json(spec_json)
    quiet_threads()
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    rows = []
    with progress("engine, speculative", 4 * len(args.batch), enabled=not args.json) as bar:
        for b in args.batch:
            for mode, cfg in (("off", None), ("on", spec)):
                bar.describe(f"batch {b}, speculation {mode}: warm-up")
                cache = StoreConfig(block_tokens=args.block_tokens, host_capacity=None)
                with LLM(args.preset, dtype=args.dtype, device=args.device, cache=cache, speculative=cfg,
                         max_seqs=max(64, b)) as llm:
                    llm.generate([tool_prompt(1000 + i) for i in range(b)], params)     # warm up
                    if cfg is not None:
                        llm.spec_stats.__init__()                                        # count the timed run only
                    bar.advance()
                    bar.describe(f"batch {b}, speculation {mode}")
                    t0 = time.perf_counter()
                    outs = llm.generate([tool_prompt(i) for i in range(b)], params)
                    wall = time.perf_counter() - t0
                    first = max(o.ttft for o in outs)
                    n = sum(len(o.token_ids) - 1 for o in outs)
                    st = llm.stats().get("spec", {})
                    bar.advance()
                rows.append({"bench": "engine-spec", "batch": b, "speculative": mode, "tokens": n,
                             "decode_tokens_per_s": round(n / (wall - first), 1) if wall > first else None,
                             "mean_acceptance_length": round(st["mean_acceptance_length"], 3) if st else None,
                             "draft_tokens": st.get("draft_tokens"), "accepted_tokens": st.get("accepted_tokens")})
    emit(rows, args.json, f"{args.preset}: decode on tool-call prompts, {args.decode_tokens} tokens per request, "
         f"speculative {spec.method} k={spec.num_speculative_tokens} vs none",
         [Column("batch", "batch"), Column("speculative", "speculative"), Column("tokens", "tokens", fmt_float(0)),
          Column("decode_tokens_per_s", "tokens/s", fmt_float(1)),
          Column("mean_acceptance_length", "mean acceptance length", lambda v: "-" if v is None else f"{v:.2f}"),
          Column("draft_tokens", "drafted", lambda v: "-" if v is None else str(v)),
          Column("accepted_tokens", "accepted", lambda v: "-" if v is None else str(v))])
    return 0
