"""Keying plus lookup of one long prompt, against raw xxh3 over the same block bytes."""
from __future__ import annotations

import argparse

HELP = "time keys() + lookup() of a long prompt against raw xxh3 over the same bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=131072, help="prompt length in tokens (default 131072)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--hash", default="xxh3", help="xxh3 (default), sha256 or blake3")
    p.add_argument("--repeat", type=int, default=20, help="timed repetitions; the median is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import xxhash

    from kvtier.bench.common import emit, quiet_threads, timeit
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.layout import KVLayout
    from kvtier.store import Store
    from kvtier.tiers import HostTier

    if args.tokens < args.block_tokens:
        raise ConfigError("--tokens must be at least one block (--block-tokens)")
    quiet_threads()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 160_000, args.tokens, dtype=np.int64)
    nblocks = args.tokens // args.block_tokens
    # The payload does not matter here: a tiny layout keeps the store small.
    layout = KVLayout.mha(1, 1, 8, args.block_tokens, torch.float16)
    store = Store(layout, [HostTier(blocks=nblocks)], Namespace("bench"), hash=args.hash)
    keys = store.keys(tokens)
    for i in range(0, nblocks, 1024):   # fill: lookup then walks the whole prompt
        store.put(keys[i:i + 1024], torch.zeros(len(keys[i:i + 1024]), layout.block_bytes, dtype=torch.uint8))
    assert store.lookup(keys).blocks == nblocks

    t_keys = timeit(lambda: store.keys(tokens), args.repeat)
    t_lookup = timeit(lambda: store.lookup(keys), args.repeat)
    t_total = timeit(lambda: store.lookup(store.keys(tokens)), args.repeat)
    as_list = tokens.tolist()
    t_total_list = timeit(lambda: store.lookup(store.keys(as_list)), args.repeat)

    data = tokens.astype("<u4").tobytes()
    step = 4 * args.block_tokens
    end = nblocks * step
    h = xxhash.xxh3_128_digest

    def raw() -> None:   # the floor: one xxh3 call per block, no chaining, no lookup
        for i in range(0, end, step):
            h(data[i:i + step])

    t_raw = timeit(raw, args.repeat)
    store.close()
    row = {
        "bench": "lookup", "tokens": args.tokens, "block_tokens": args.block_tokens, "blocks": nblocks,
        "hash": args.hash, "keys_ms": t_keys * 1e3, "lookup_ms": t_lookup * 1e3, "total_ms": t_total * 1e3,
        "total_ms_list_input": t_total_list * 1e3, "baseline": "xxh3_128 per block, unchained",
        "baseline_ms": t_raw * 1e3, "ratio": t_raw / t_total,
    }
    emit([row], args.json, "kvtier bench lookup (ratio = raw time / kvtier time; 1.0 = raw speed)",
         ["tokens", "blocks", "keys_ms", "lookup_ms", "total_ms", "total_ms_list_input", "baseline_ms", "ratio"])
    return 0
