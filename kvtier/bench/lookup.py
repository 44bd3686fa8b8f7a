"""Keying plus lookup of one long prompt, against raw xxh3 over the same block bytes."""
from __future__ import annotations

import argparse

HELP = "time keys() + lookup() of a long prompt against raw xxh3 over the same bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_int

    p.add_argument("--tokens", type=positive_int, default=131072, metavar="N",
                   help="prompt length in tokens, at least one block (default 131072)")
    p.add_argument("--block-tokens", type=positive_int, default=16, metavar="N", help="tokens per block (default 16)")
    p.add_argument("--hash", default="xxh3", choices=("xxh3", "sha256", "blake3"),
                   help="the key hash: xxh3 (default), sha256 or blake3")
    p.add_argument("--repeat", type=positive_int, default=20, metavar="N",
                   help="timed repetitions; the median is reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import xxhash

    from kvtier.bench.common import Column, emit, fmt_float, memory_hint, quiet_threads, timeit
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.layout import KVLayout
    from kvtier.progress import progress
    from kvtier.store import Store
    from kvtier.tiers import HostTier

    if args.tokens < args.block_tokens:
        raise ConfigError(f"--tokens {args.tokens} is less than one block (--block-tokens {args.block_tokens}): "
                          "give more tokens or smaller blocks")
    quiet_threads()
    with memory_hint(f"--tokens {args.tokens:,} does not fit in memory: give fewer"), \
            progress("lookup", 6, enabled=not args.json) as bar:
        bar.describe("filling the store")
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
        bar.advance()

        def timed(what: str, fn) -> float:
            bar.describe(what)
            t = timeit(fn, args.repeat)
            bar.advance()
            return t

        t_keys = timed("keys", lambda: store.keys(tokens))
        t_lookup = timed("lookup", lambda: store.lookup(keys))
        t_total = timed("keys + lookup", lambda: store.lookup(store.keys(tokens)))
        as_list = tokens.tolist()
        t_total_list = timed("keys + lookup of a list", lambda: store.lookup(store.keys(as_list)))

        data = tokens.astype("<u4").tobytes()
        step = 4 * args.block_tokens
        end = nblocks * step
        h = xxhash.xxh3_128_digest

        def raw() -> None:   # the floor: one xxh3 call per block, no chaining, no lookup
            for i in range(0, end, step):
                h(data[i:i + step])

        t_raw = timed("raw xxh3", raw)
    store.close()
    row = {
        "bench": "lookup", "tokens": args.tokens, "block_tokens": args.block_tokens, "blocks": nblocks,
        "hash": args.hash, "keys_ms": t_keys * 1e3, "lookup_ms": t_lookup * 1e3, "total_ms": t_total * 1e3,
        "total_ms_list_input": t_total_list * 1e3, "baseline": "xxh3_128 per block, unchained",
        "baseline_ms": t_raw * 1e3, "ratio": t_raw / t_total,
    }
    ms = fmt_float(3)
    emit([row], args.json, f"keys + lookup vs raw xxh3 per block ({args.hash} keys; ratio = raw / kvtier)",
         [Column("tokens", "tokens", fmt_float(0)), Column("blocks", "blocks", fmt_float(0)),
          Column("keys_ms", "keys ms", ms), Column("lookup_ms", "lookup ms", ms),
          Column("total_ms", "keys+lookup ms", ms), Column("total_ms_list_input", "from a list ms", ms),
          Column("baseline_ms", "raw ms", ms), Column("ratio", "ratio", fmt_float(2))])
    return 0
