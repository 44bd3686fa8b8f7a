"""Tier put/get bandwidth against a raw copy between page-aligned buffers, same run."""
from __future__ import annotations

import argparse

HELP = "time put and get of blocks through a tier against a raw memcpy of the same bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", default="host", choices=["host"], help="tier to measure (default host)")
    p.add_argument("--block-bytes", default="64KiB,1MiB,4MiB", help="comma-separated block sizes")
    p.add_argument("--total", default="256MiB", help="bytes moved per timed operation (default 256MiB)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from kvtier.bench.common import emit, quiet_threads, timeit
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.layout import KVLayout
    from kvtier.store import Store
    from kvtier.tiers import HostTier
    from kvtier.tiers.memory import allocate_host
    from kvtier.units import parse_bytes

    quiet_threads()
    total = parse_bytes(args.total)
    rows = []
    for spec in args.block_bytes.split(","):
        bb = parse_bytes(spec)
        if bb % 32 or bb < 32:
            raise ConfigError(f"block size {spec} must be a positive multiple of 32 bytes")
        n = max(1, total // bb)
        # One layer, one head, uint8: a layout whose block is exactly `bb` bytes.
        layout = KVLayout.mha(1, 1, bb // 32, 16, torch.uint8)
        store = Store(layout, [HostTier(blocks=n)], Namespace("bench"))
        src = allocate_host(n * bb, pin=None).tensor[: n * bb].view(n, bb)
        src.random_(0, 255)
        out = allocate_host(n * bb, pin=None).tensor[: n * bb].view(n, bb)
        rng = np.random.default_rng(0)
        # Fresh keys every round (made before timing): real writes, evicting the last round.
        rounds = iter([store.keys(rng.integers(0, 2**31, 16 * n)) for _ in range(args.repeat + 1)])
        timed_put = timeit(lambda: store.put(next(rounds), src), args.repeat)
        keys = store.keys(rng.integers(0, 2**31, 16 * n))
        store.put(keys, src)
        timed_get = timeit(lambda: store.get(keys, out), args.repeat)
        assert torch.equal(out, src), "get returned different bytes than put"
        # Raw baseline: one memcpy of the same bytes between page-aligned buffers.
        a, b = src.numpy(), out.numpy()
        timed_raw = timeit(lambda: np.copyto(b, a), args.repeat)
        raw_gbps = n * bb / timed_raw / 1e9
        info = store.stats().tiers[0].info
        for op, t in (("put", timed_put), ("get", timed_get)):
            gbps = n * bb / t / 1e9
            rows.append({"tier": args.tier, "op": op, "block_bytes": bb, "blocks": n, "gbps": gbps,
                         "baseline_gbps": raw_gbps, "ratio": gbps / raw_gbps, "memory": info.get("memory")})
        store.close()
    emit(rows, args.json, "kvtier bench tiers (baseline: raw memcpy between page-aligned buffers)",
         ["tier", "op", "block_bytes", "gbps", "baseline_gbps", "ratio", "memory"])
    return 0
