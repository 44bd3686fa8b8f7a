"""Measured step costs for the disaggregation model (kvtier/sim/disagg.py): the reference
engine's prefill cost per prompt token and its decode step's fixed and per-sequence costs,
timed on this machine, so the model runs on what this machine really does before its
predictions at GPU-scale costs are trusted.

Prefill per token is the slope between a long and a short prompt's first-token time (fresh
prompts: nothing cached); a decode step's cost is the time per generated token past the
first, at batch 1 and batch `batch`, split into a fixed part and a per-sequence part by the
line through the two.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from kvtier.sim.disagg import Costs


@dataclass(frozen=True)
class Measured:
    """What was timed, and the model's Costs derived from it."""

    costs: Costs
    prefill_tokens: tuple[int, int]          # the short and the long prompt
    prefill_s: tuple[float, float]           # their first-token times (medians)
    step_s: dict[int, float]                 # decode batch -> seconds per step (medians)


def measure_costs(model: str = "kimi-tiny", *, long: int = 1024, short: int = 64, batch: int = 16,
                  decode_tokens: int = 24, repeat: int = 3, link_bytes_per_s: float = 50e9,
                  seed: int = 0) -> Measured:
    """Time the engine here; `long` is also the model's chunk (the engine's token budget)."""
    import torch

    from kvtier.config import StoreConfig
    from kvtier.engine import LLM, SamplingParams

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    block_tokens = 16
    with LLM(model, seed=seed, max_batched_tokens=long, cache=StoreConfig(block_tokens=block_tokens)) as llm:
        vocab = min(llm.config.vocab_size, 256)

        def prompt(n: int) -> list[int]:         # random tokens: never a prefix hit
            return rng.integers(0, vocab, n).tolist()

        def timed(prompts: list[list[int]], tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            return time.perf_counter() - t0

        timed([prompt(short)], 2)                # warm up the code paths
        pre = tuple(statistics.median(timed([prompt(n)], 1) for _ in range(repeat)) for n in (short, long))
        steps = {}
        for b in sorted({1, batch}):
            per = [(timed([prompt(short) for _ in range(b)], decode_tokens)
                    - timed([prompt(short) for _ in range(b)], 1)) / (decode_tokens - 1) for _ in range(repeat)]
            steps[b] = statistics.median(per)
        kv_bytes_per_token = llm.store.layout.block_bytes // block_tokens
    per_token = max(0.0, (pre[1] - pre[0]) / (long - short))
    per_seq = max(0.0, (steps[batch] - steps[1]) / (batch - 1)) if batch > 1 else 0.0
    costs = Costs(prefill_per_token_s=per_token, decode_base_s=max(0.0, steps[1] - per_seq),
                  decode_per_seq_s=per_seq, kv_bytes_per_token=kv_bytes_per_token,
                  link_bytes_per_s=link_bytes_per_s, chunk=long)
    return Measured(costs, (short, long), pre, steps)   # type: ignore[arg-type]
