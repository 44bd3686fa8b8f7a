"""Where a host-tier hit's time goes, against the same prompt with its prefix resident.

`kvtier bench engine` reports a host hit's TTFT and `vs_resident` (issue 19's goal: within
10 %). This splits both into the engine loop's four steps (schedule, prepare, run,
postprocess: `LLM.phase_seconds`), the host work inside them (evicting for the pages,
starting the load, publishing the loaded pages) and beside them (on a GPU, the loader's
thread issuing the copies, whose Python competes with the steps' for the GIL), and the time the forward pass waited for
the layer-wise load (`PageLoad.wait_for_layer`, all layers and layer 0), the median of 8
rounds, in ms; then the runs of the load's copies (consecutive host slots into consecutive
pages: one 2D DMA each per layer group on a GPU; 239 for 254 blocks in session 16, 1-14 in
session 21) and a cProfile of one host hit, top functions by own time.

    python bench/host_hit.py [--preset kimi-tiny] [--device cuda|cpu] [--prompt-tokens 4096]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvtier import StoreConfig
from kvtier import adapter as adapter_module
from kvtier import index as index_module
from kvtier import pool as pool_module
from kvtier.transfer import streams as streams_module
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.generate_cli import kv_block_bytes, model_config
from kvtier.transfer.runs import runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kimi-tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)

    waits = {"all": 0.0, "layer0": 0.0}
    held_runs: list[int] = []
    wait_for_layer = adapter_module.PageLoad.wait_for_layer

    def timed_wait(self: Any, layer: int) -> None:
        t = time.perf_counter()
        wait_for_layer(self, layer)
        d = time.perf_counter() - t
        waits["all"] += d
        if layer == 0:
            waits["layer0"] += d
    adapter_module.PageLoad.wait_for_layer = timed_wait      # type: ignore[method-assign]

    copy_lower = adapter_module.KVAdapter._copy_lower

    def counted(self: Any, plan: Any, tier: Any) -> Any:
        slots = [s for _, s in plan.store_locs]
        pages = [plan.pages[i] for i in plan.lower]
        held_runs.append((len(runs(slots, pages)), len(runs(slots, slots)), len(runs(pages, pages))))
        return copy_lower(self, plan, tier)
    adapter_module.KVAdapter._copy_lower = counted             # type: ignore[method-assign]

    # The host work around the copies (issue 19's gap on an H200 in session 21): evicting the
    # other prompt's blocks for the pages, starting the load, publishing the loaded pages (each
    # label times every call of its function in the request: the resident request's too).
    books: dict[str, float] = {}
    for label, owner, name in (("evict", index_module.BlockIndex, "allocate"),
                               ("start load", adapter_module.KVAdapter, "_copy_lower"),
                               ("publish", pool_module.PagePool, "cache"),
                               # on the loader's thread, beside the steps, a GPU's only: issuing the
                               # layer groups' copies (its Python holds the GIL the steps need)
                               ("loader issue", streams_module.LayerLoader, "_layerwise")):
        setattr(owner, name, _timed(getattr(owner, name), books, label))

    bt, n = 16, args.prompt_tokens
    cfg = model_config(args.preset, "--preset")
    bb = kv_block_bytes(cfg, None, bt)
    pages = -(-(n + 2) // bt) + 1
    cache = StoreConfig(block_tokens=bt, device_capacity=pages * bb, host_capacity=8 * pages * bb)
    llm = LLM(args.preset, device=args.device, cache=cache, max_batched_tokens=8192, max_seqs=64)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompt() -> list[int]:
        return rng.integers(0, 256, n).tolist()

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def drain() -> None:
        if llm.store.backup is not None:
            llm.store.backup.drain()

    def timed(p: list[int], prof: cProfile.Profile | None = None) -> tuple[float, dict[str, float], float, float, dict]:
        sync()
        before = dict(llm.phase_seconds)
        waits["all"] = waits["layer0"] = 0.0
        books.clear()
        if prof:
            prof.enable()
        out = llm.generate([p], one)[0]
        if prof:
            prof.disable()
        loader = llm.adapter._pool_loader
        if loader is not None and loader._thread is not None:   # its issue time is in before reading it
            loader._thread.submit(lambda: None).result()
        phases = {k: (llm.phase_seconds[k] - before[k]) * 1e3 for k in before}
        phases.update({k: v * 1e3 for k, v in books.items()})
        return out.ttft * 1e3, phases, waits["all"] * 1e3, waits["layer0"] * 1e3, dict(out.cached_by_tier)

    rows = []
    prof = cProfile.Profile()
    for i in range(args.rounds + 1):
        p = prompt()
        llm.generate([p[:-1] + [(p[-1] + 1) % 256]], one)      # computes and caches the prefix
        llm.generate([prompt()], one)                          # pushes it down to host memory
        drain()
        host = timed(p, prof if i == args.rounds else None)
        drain()
        resident = timed(p)
        if i:                                                  # round 0 warms up
            rows.append((host, resident))
    print(f"{args.preset} on {args.device}, {n}-token prompt: host hit from {rows[-1][0][4]}, "
          f"resident from {rows[-1][1][4]}")

    def med(f: Any) -> float:
        return statistics.median(f(x) for x in rows)
    for name, j in (("host", 0), ("resident", 1)):
        steps = " ".join(f"{k} {med(lambda x, k=k: x[j][1].get(k, 0.0)):.2f}" for k in rows[0][0][1])
        print(f"{name:9s} ttft {med(lambda x: x[j][0]):.2f} ms: {steps}; waited for layers "
              f"{med(lambda x: x[j][2]):.2f} (layer 0 {med(lambda x: x[j][3]):.2f})")
    print(f"vs_resident {statistics.median(h[0] / r[0] for h, r in rows):.3f}")
    print("runs per host hit (copies: host slot and page both consecutive; host slots; pages): "
          f"{held_runs[-args.rounds:]}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[-5000:])
    llm.close()


def _timed(f: Any, into: dict[str, float], label: str) -> Any:
    """`f`, adding its wall time to into[label] on each call."""
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            into[label] = into.get(label, 0.0) + time.perf_counter() - t
    return timed


if __name__ == "__main__":
    main()
