"""The reference engine: time to first token with a cached prefix (device, host, disk)
against the same-length prompt computed from scratch, in the same run; decode tokens/s."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

HELP = "engine TTFT with a cached prefix (device, host, disk) vs from scratch; decode tokens/s at batch 1 and 16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="kimi-tiny", help="model preset (default kimi-tiny) or a checkpoint folder")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length; all but the last block is the shared prefix")
    p.add_argument("--tiers", default="device,host,disk", help="which cached-prefix cases to time (default all three)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per case; medians are reported")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per request in the decode runs")
    p.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--disk", default=None, help="folder for the disk case (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from kvtier.bench.common import emit, quiet_threads
    from kvtier.engine import CacheConfig, LLM, SamplingParams
    from kvtier.errors import ConfigError

    try:
        batches = [int(x) for x in args.batch.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--batch takes comma-separated batch sizes, e.g. 1,16: {e}") from e
    if any(b < 1 for b in batches) or args.repeat < 1 or args.decode_tokens < 2:
        raise ConfigError("--batch sizes and --repeat must be >= 1, --decode-tokens >= 2")
    cases = [c.strip() for c in args.tiers.split(",") if c.strip()]
    if not set(cases) <= {"device", "host", "disk"}:
        raise ConfigError(f"--tiers takes device, host and disk, got {args.tiers!r}")
    bt = args.block_tokens
    if args.prompt_tokens < 2 * bt:
        raise ConfigError(f"--prompt-tokens must be at least two blocks ({2 * bt})")
    quiet_threads()
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def prompt(vocab: int) -> list[int]:
        return rng.integers(0, min(vocab, 256), args.prompt_tokens).tolist()

    def engine(kv_blocks: int, host: bool, disk: str | None) -> LLM:
        bb = _layout_bytes(args)
        cache = CacheConfig(block_tokens=bt, kv_cache=kv_blocks * bb, host_cache=8 * kv_blocks * bb if host else None,
                            disk_path=disk, disk_cache=8 * kv_blocks * bb)
        return LLM(args.preset, dtype=args.dtype, device=args.device, cache=cache, max_batched_tokens=512)

    def ttft(llm: LLM, p: list[int]) -> tuple[float, dict[str, int], int]:
        o = llm.generate([p], one)[0]
        return o.ttft, o.cached_by_tier, o.cached_tokens

    pages = -(-(args.prompt_tokens + 2) // bt)
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-engine-")
    for case in cases:
        # The device tier holds one prompt and a bit: a second prompt pushes the first one
        # down to host memory or disk, where the timed request then finds it.
        disk = (args.disk or tmp.name) + f"/{case}" if case == "disk" else None
        llm = engine(pages * 4 if case == "device" else pages + 1, case == "host", disk)
        try:
            vocab = llm.config.vocab_size
            ttft(llm, prompt(vocab))                                      # warm up the code paths
            cold, hot, where, cached = [], [], {}, 0
            for _ in range(args.repeat):
                cold.append(ttft(llm, prompt(vocab))[0])                  # from scratch
                p = prompt(vocab)
                ttft(llm, p[:-1] + [(p[-1] + 1) % 256])                   # caches the shared prefix
                if case != "device":
                    ttft(llm, prompt(vocab))                              # pushes it down a tier
                t, where, cached = ttft(llm, p)
                hot.append(t)
        finally:
            llm.close()
        c, h = statistics.median(cold), statistics.median(hot)
        rows.append({"bench": "engine-ttft", "case": case, "prompt_tokens": args.prompt_tokens,
                     "cached_tokens": cached, "cached_from": where, "ttft_cached_ms": round(h * 1e3, 2),
                     "ttft_scratch_ms": round(c * 1e3, 2), "speedup": round(c / h, 2)})
    tmp.cleanup()
    for b in batches:
        llm = engine(b * (-(-(64 + args.decode_tokens) // bt)) + 64, False, None)
        try:
            params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
            prompts = [rng.integers(0, 256, 64).tolist() for _ in range(b)]
            llm.generate(prompts, params)                                 # warm up
            prompts = [rng.integers(0, 256, 64).tolist() for _ in range(b)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            first = max(o.ttft for o in outs)
            n = sum(len(o.token_ids) - 1 for o in outs)
        finally:
            llm.close()
        rows.append({"bench": "engine-decode", "batch": b, "tokens": n,
                     "decode_tokens_per_s": round(n / (wall - first), 1) if wall > first else None,
                     "ms_per_step": round((wall - first) / max(1, args.decode_tokens - 1) * 1e3, 2)})
    emit(rows, args.json, f"engine: {args.preset}, {args.prompt_tokens}-token prompts",
         ["bench", "case", "batch", "cached_tokens", "cached_from", "ttft_cached_ms", "ttft_scratch_ms", "speedup",
          "decode_tokens_per_s", "ms_per_step"])
    return 0


def _layout_bytes(args: argparse.Namespace) -> int:
    """Bytes of one KV block of the model, to size the tiers in blocks."""
    from pathlib import Path

    import torch

    from kvtier.engine.config import ModelConfig, preset, preset_names
    from kvtier.errors import ConfigError
    from kvtier.engine.model.loader import compute_dtype

    if args.preset not in preset_names() and not Path(args.preset).is_dir():
        raise ConfigError(f"--preset {args.preset!r} is neither a preset ({', '.join(preset_names())}) nor a "
                          "checkpoint folder")
    cfg = preset(args.preset) if args.preset in preset_names() else ModelConfig.from_hf(args.preset)
    itemsize = torch.empty((), dtype=compute_dtype(args.dtype, cfg)).element_size()
    return cfg.num_hidden_layers * args.block_tokens * cfg.kv_entry_dim * itemsize
