"""Where a disk put's time goes beyond the raw write: each step of it, and two stand-ins for
the checksum, timed against raw O_DIRECT writes of the same bytes, alternated in one run.

    python bench/disk_contention.py [--dir DIR] [--total 512MiB] [--block 1MiB] [--repeat 15]

Rows (each a paired ratio to the raw write, with its 90% interval; see kvtier.bench.common):
- `raw + cpu work`: the raw write while another thread burns as much CPU time as hashing the
  bytes takes, touching no memory (SHA-256 of one 256 KiB buffer in cache, GIL released).
- `raw + hash other`: the raw write while another thread hashes (xxh3, as the tier does) a
  different buffer of the same size: the checksum's memory reads without its bytes.
- `raw + hash same`: the raw write while another thread hashes the bytes being written:
  what the tier's checksums cost a write, without anything else of the tier.
- `tier write`: `DiskTier.write` with slots given (no store): the writes, the checksums
  beside them on the calling thread, the records' commit.
- `store put`: `Store.put` of fresh keys into a full tier: the above plus reserving slots and
  evicting the previous round's blocks.

Read together: `raw + cpu work` against `raw + hash other` tells whether a checksum beside
the writes costs them CPU time or memory traffic; `tier write` against `raw + hash same`,
what the tier adds beyond its checksums; `store put` against `tier write`, what the index
adds. On a virtual disk whose
speed drifts, only differences larger than the intervals mean anything.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from kvtier.argtypes import size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="an existing directory on the disk to measure")
    ap.add_argument("--total", type=size, default=512 << 20, help="bytes per write (default 512MiB)")
    ap.add_argument("--block", type=size, default=1 << 20, help="block size (default 1MiB)")
    ap.add_argument("--repeat", type=int, default=15, help="paired rounds per row (default 15)")
    args = ap.parse_args(argv)
    if args.dir is not None and not args.dir.is_dir():
        ap.error(f"--dir {args.dir} is not an existing directory")
    if args.block < 4096 or args.block % 4096 or args.total < args.block or args.repeat < 1:
        ap.error("--block must be a positive multiple of 4 KiB, --total at least one block, --repeat >= 1")

    import numpy as np
    import torch

    from kvtier.bench.common import timeit_pair
    from kvtier.bench.tiers import RawDisk, _layout
    from kvtier.checksum import block_checksums
    from kvtier.keys import Namespace
    from kvtier.store import Store
    from kvtier.tiers import DiskTier
    from kvtier.tiers.memory import allocate_host

    torch.set_num_threads(1)
    bb, n = args.block, args.total // args.block
    root = Path(tempfile.mkdtemp(prefix="kvtier-contention-", dir=args.dir))
    try:
        tier = DiskTier(root / "tier", blocks=n, io_threads=4)
        store = Store(_layout(bb), [tier], Namespace("contention"))
        raw = RawDisk(tier.path / "slab.bin", n * tier.slot_bytes, tier._chunk_slots * tier.slot_bytes, 4)
        src = allocate_host(n * bb).tensor[: n * bb].view(n, bb)
        src.random_(0, 255)
        rows = [src[i].numpy() for i in range(n)]
        other = allocate_host(n * bb).array[: n * bb].reshape(n, bb)
        other[:] = 1

        t0 = time.perf_counter()
        block_checksums(rows)                      # as the tier does: one call, one GIL release
        hash_s = time.perf_counter() - t0          # how long the tier's checksums take alone
        small = bytes(256 << 10)

        def cpu_work() -> None:
            end = time.perf_counter() + hash_s
            while time.perf_counter() < end:
                hashlib.sha256(small)

        def hash_other() -> None:
            block_checksums(list(other))

        def hash_same() -> None:
            block_checksums(list(raw.buf.array[: n * tier.slot_bytes].reshape(n, tier.slot_bytes)))

        def beside(work):
            def run() -> None:
                th = threading.Thread(target=work)
                th.start()
                raw.write()
                th.join()
            return run

        slots = list(range(n))

        def tier_write() -> None:
            tier.write(slots, rows, keys=[os.urandom(16) for _ in range(n)])

        rng = np.random.default_rng(0)
        fresh = iter([store.keys(rng.integers(0, 2**31, 16 * n)) for _ in range(args.repeat + 2)])

        def store_put() -> None:
            store.put(next(fresh), src)

        print(json.dumps({"hash_alone_ms": round(hash_s * 1e3, 2), "blocks": n, "block_bytes": bb}))
        try:
            for name, fn in [("raw + cpu work", beside(cpu_work)), ("raw + hash other", beside(hash_other)),
                             ("raw + hash same", beside(hash_same)),
                             ("tier write", tier_write), ("store put", store_put)]:
                p = timeit_pair(fn, raw.write, args.repeat)
                print(json.dumps({"row": name, "ms": round(p.a * 1e3, 2), "raw_ms": round(p.b * 1e3, 2),
                                  "ratio": round(p.ratio, 3), "ratio_low": round(p.low, 3),
                                  "ratio_high": round(p.high, 3)}), flush=True)
        finally:
            raw.close()
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
