"""`kvtier generate`: run the reference engine on a prompt and show what the cache did."""
from __future__ import annotations

import argparse
import json
import time

HELP = "generate text with the reference Kimi-class engine (MLA + MoE) over a kvtier store"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="a preset with random weights, e.g. kimi-tiny (the default)")
    src.add_argument("--model", default=None, help="a Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several (they run as one batch)")
    p.add_argument("--prompt-ids", default=None, help="a prompt as comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--session", default=None, help="pin this session's prefix in the store (TTL 300 s)")
    p.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 ... (default: float32 on a CPU)")
    p.add_argument("--kv-cache", default="256MiB", help="device tier: the engine's KV pages (default 256MiB)")
    p.add_argument("--host-cache", default="1GiB", help="host-memory tier below it; 0 for none")
    p.add_argument("--disk", default=None, help="a folder for a disk tier below host memory (kept across runs)")
    p.add_argument("--disk-cache", default="1GiB", help="size of the disk tier (default 1GiB, allocated up front)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from kvtier.engine import CacheConfig, LLM, SamplingParams
    from kvtier.errors import ConfigError

    if args.prompt is None and args.prompt_ids is None:
        raise ConfigError("give --prompt TEXT (or --prompt-ids 1,2,3)")
    prompts: list = list(args.prompt or [])
    if args.prompt_ids is not None:
        try:
            prompts.append([int(t) for t in args.prompt_ids.split(",") if t.strip()])
        except ValueError as e:
            raise ConfigError(f"--prompt-ids must be comma-separated integers: {e}") from e
    cache = CacheConfig(block_tokens=args.block_tokens, kv_cache=args.kv_cache,
                        host_cache=None if str(args.host_cache) in ("0", "none", "") else args.host_cache,
                        disk_path=args.disk, disk_cache=args.disk_cache)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    with LLM(args.model or args.preset or "kimi-tiny", seed=args.weights_seed, dtype=args.dtype,
             device=args.device, cache=cache) as llm:
        if not args.json:
            print(f"model: {llm.info.describe()}")
            if llm.info.random_weights:
                print("note: this preset's weights are random (made from a seed), so its text is noise; "
                      "it runs the whole engine and cache path. Pass --model CHECKPOINT_DIR for real output.")
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, sessions=[args.session] * len(prompts))
        wall = time.perf_counter() - t0
        for o in outs:
            if args.json:
                print(json.dumps({"random_weights": llm.info.random_weights, "text": o.text, "token_ids": o.token_ids, "prompt_tokens": len(o.prompt_token_ids),
                                  "cached_tokens": o.cached_tokens, "cached_by_tier": o.cached_by_tier,
                                  "finish_reason": o.finish_reason, "ttft_s": o.ttft, "wall_s": wall}))
            else:
                where = ", ".join(f"{n} blocks from {t}" for t, n in o.cached_by_tier.items())
                print(f"\n{o.text!r}\n  {len(o.prompt_token_ids)} prompt tokens, {o.cached_tokens} of them from the "
                      f"cache{f' ({where})' if where else ''}; {len(o.token_ids)} generated ({o.finish_reason}); "
                      f"first token after {o.ttft * 1000:.1f} ms")
        if not args.json:
            n = sum(len(o.token_ids) for o in outs)
            print(f"\n{n} tokens in {wall:.2f} s")
    return 0
