"""Tier put/get bandwidth against a raw copy of the same bytes, in the same run.

host: a raw memcpy between page-aligned buffers.
disk: raw O_DIRECT pwritev/preadv of the same bytes with the tier's thread count and
bytes per syscall (so the ratio is the tier's overhead, not its parallelism), a buffered
pread of a cold file, and for puts the same raw writes with each block's xxh3 taken beside
them (`checksum_floor`: what any put that checksums every byte gets here, as a ratio to raw).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.bench.common import Paired

HELP = "time put and get of blocks through a tier against a raw copy of the same bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_int, size
    from kvtier.bench.common import size_list

    p.add_argument("--tier", default="host", choices=["host", "disk", "device"],
                   help="tier to measure: host, disk, or device (the transfer path into engine pages; "
                        "default host)")
    p.add_argument("--block-bytes", type=size_list, default=None, metavar="SIZES",
                   help="comma-separated block sizes, multiples of 32 bytes (256 for device) "
                        "(default 64KiB,1MiB,4MiB; 1MiB,4MiB for disk)")
    p.add_argument("--total", type=size, default=None, metavar="SIZE",
                   help="bytes moved per timed operation, at least one block "
                        "(default 256MiB host, 512MiB disk, 1GiB device on a GPU, 64MiB on a CPU)")
    p.add_argument("--path", default=None, metavar="DIR",
                   help="disk: an existing directory for the slab files (default: a temporary directory)")
    p.add_argument("--io-threads", type=positive_int, default=None, metavar="N",
                   help="disk: I/O threads, for the tier and the baseline (default 4)")
    p.add_argument("--repeat", type=positive_int, default=None, metavar="N",
                   help="timed rounds, each the operation and its raw baseline: the median of the rounds' "
                        "ratios is reported, with a 90%% interval (default: 9; 21 for disk, whose speed "
                        "drifts more from round to round)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


# Bytes per timed operation and block sizes when not given.
DEFAULT_TOTAL = {"host": 256 << 20, "disk": 512 << 20, "device": 64 << 20}
DEFAULT_SIZES = {"host": [64 << 10, 1 << 20, 4 << 20], "disk": [1 << 20, 4 << 20], "device": [64 << 10, 1 << 20, 4 << 20]}
# Timed rounds when not given: a virtual disk's round-to-round spread (0.8-1.05 of raw
# for the same put) needs more of them for a median that holds from run to run.
DEFAULT_REPEAT = {"host": 9, "disk": 21, "device": 9}
# A block size must make a whole layout: 32 bytes for the 1-layer layout here, 256 for the
# device benchmark's 4 layers x K,V x 32 tokens.
MULTIPLE = {"host": 32, "disk": 32, "device": 256}
# Buffers of --total bytes each run holds at once (tier, source, destination, baselines).
HOLDS = {"host": 5, "disk": 3, "device": 6}
# Timed phases per block size, for the progress bar.
PHASES = {"host": 2, "disk": 4, "device": 6}


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import (Column, check_block_sizes, emit, existing_dir, fmt_float, fmt_size,
                                     interval_column, memory_hint, quiet_threads)
    from kvtier.errors import ConfigError
    from kvtier.progress import progress

    tier = args.tier
    if args.path is not None and tier != "disk":
        raise ConfigError("--path is for --tier disk only (the directory for its slab files)")
    if args.io_threads is not None and tier != "disk":
        raise ConfigError("--io-threads is for --tier disk only (the disk tier's I/O threads)")
    args.io_threads = args.io_threads or 4
    sizes = args.block_bytes or DEFAULT_SIZES[tier]
    args.repeat = args.repeat or DEFAULT_REPEAT[tier]
    total = args.total or DEFAULT_TOTAL[tier]
    check_block_sizes(sizes, total, MULTIPLE[tier])
    path = existing_dir("--path", args.path)
    quiet_threads()
    gbps = fmt_float(2)
    head = [Column("op", "op"), Column("block_bytes", "block", fmt_size), Column("gbps", "GB/s", gbps),
            Column("baseline_gbps", "raw GB/s", gbps), Column("ratio", "ratio", fmt_float(2))]
    rows: list[dict] = []
    hint = (f"this benchmark holds about {HOLDS[tier]} times --total ({fmt_size(total)}) in memory: "
            "give a smaller --total")
    with memory_hint(hint), progress(f"{tier} tier", len(sizes) * PHASES[tier], enabled=not args.json) as bar:
        if tier == "device":
            from kvtier.transfer.bench import bench_device
            rows = bench_device(args, bar)
        else:
            for bb in sizes:
                rows += _disk(bb, total, args, path, bar) if tier == "disk" else _host(bb, total, args, bar)
    if tier == "device":
        title = f"device tier vs raw copies; {rows[0]['device']}, {rows[0]['impl']}" if rows else "device tier"
        emit(rows, args.json, title, head + [interval_column(), Column("baseline", "raw copy")], left=1)
    elif tier == "disk":
        title = (f"disk tier vs raw O_DIRECT; {rows[0]['filesystem']}, {rows[0]['io']}, {args.io_threads} threads"
                 if rows else "disk tier")
        emit(rows, args.json, title, head + [interval_column(), Column("checksum_floor", "raw+xxh3", fmt_float(2)),
                                             Column("cold_pread_gbps", "cold pread GB/s", gbps)], left=1)
    else:
        title = f"host tier vs raw memcpy; {rows[0]['memory']} memory" if rows else "host tier"
        emit(rows, args.json, title, head + [interval_column()], left=1)
    return 0


def _layout(bb: int):
    import torch

    from kvtier.errors import ConfigError
    from kvtier.layout import KVLayout

    if bb % 32 or bb < 32:
        raise ConfigError(f"block size {bb} must be a positive multiple of 32 bytes")
    return KVLayout.mha(1, 1, bb // 32, 16, torch.uint8)   # one layer, one head: exactly bb bytes


def _put_get(store, n: int, bb: int, repeat: int, bar, raw_put, raw_get) -> tuple[Paired, Paired]:
    """A put of n fresh blocks (evicting the last round) alternated with raw_put, and a get of
    n blocks alternated with raw_get: two Paired. `bar` (a kvtier.progress.Progress)
    advances by one per timed phase."""
    import numpy as np
    import torch

    from kvtier.bench.common import fmt_size, timeit_pair
    from kvtier.tiers.memory import allocate_host

    src = allocate_host(n * bb).tensor[: n * bb].view(n, bb)
    src.random_(0, 255)
    out = allocate_host(n * bb).tensor[: n * bb].view(n, bb)
    rng = np.random.default_rng(0)
    rounds = iter([store.keys(rng.integers(0, 2**31, 16 * n)) for _ in range(repeat + 2)])
    keys = store.keys(rng.integers(0, 2**31, 16 * n))

    def put() -> None:
        store.put(next(rounds), src)

    def get() -> None:
        if store.get(keys, out).loaded != n:
            raise AssertionError("a block failed verification in the benchmark")

    what = f"{store.tiers[0].kind} tier, {fmt_size(bb)} blocks"
    bar.describe(f"{what}: put")
    p_put = timeit_pair(put, raw_put, repeat)
    bar.advance()
    bar.describe(f"{what}: get")
    store.put(keys, src)
    p_get = timeit_pair(get, raw_get, repeat)
    bar.advance()
    assert torch.equal(out, src), "get returned different bytes than put"
    return p_put, p_get


def _host(bb: int, total: int, args, bar) -> list[dict]:
    import numpy as np

    from kvtier.keys import Namespace
    from kvtier.store import Store
    from kvtier.tiers import HostTier
    from kvtier.tiers.memory import allocate_host

    n = total // bb
    store = Store(_layout(bb), [HostTier(blocks=n)], Namespace("bench"))
    a = allocate_host(n * bb).array[: n * bb]
    a[:] = 7
    b = allocate_host(n * bb).array[: n * bb]

    def memcpy() -> None:
        np.copyto(b, a)
    p_put, p_get = _put_get(store, n, bb, args.repeat, bar, memcpy, memcpy)
    memory = store.stats().tiers[0].info.get("memory")
    store.close()
    return [{"tier": "host", "op": op, "block_bytes": bb, "blocks": n, "gbps": n * bb / p.a / 1e9,
             "baseline_gbps": n * bb / p.b / 1e9, **p.fields(), "memory": memory}
            for op, p in (("put", p_put), ("get", p_get))]


def _disk(bb: int, total: int, args, path, bar) -> list[dict]:
    import shutil
    import tempfile
    from pathlib import Path

    from kvtier.bench.common import fmt_size, timeit_pair
    from kvtier.keys import Namespace
    from kvtier.store import Store
    from kvtier.tiers import DiskTier

    n = total // bb
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=path))
    try:
        tier = DiskTier(root / "tier", blocks=n, io_threads=args.io_threads)
        store = Store(_layout(bb), [tier], Namespace("bench"))
        chunk = tier._chunk_slots * tier.slot_bytes   # the tier's bytes per syscall
        io = tier.info()["io"]
        # The baseline writes and reads the tier's own slab file (its blocks are rewritten
        # before anything reads them): the same extents at the same offsets. A file of its
        # own measured 0.78-0.99 of the tier's speed from one run to the next here, as where
        # each file lands on the virtual disk varied; the same file, 0.90-0.91.
        raw = RawDisk(tier.path / "slab.bin", n * tier.slot_bytes, chunk, args.io_threads)
        try:
            p_put, p_get = _put_get(store, n, bb, args.repeat, bar, raw.write, raw.read)
            # The floor a checksummed put meets here: the same raw writes with every block
            # hashed beside them, as the tier hashes a put's (the checksum's read of each byte
            # slows the writes on this VM's disk: docs/benchmarks.md#disk-tier)
            bar.describe(f"disk tier, {fmt_size(bb)} blocks: raw writes with checksums beside them")
            floor = timeit_pair(lambda: raw.write(hash_rows=bb), raw.write, args.repeat)
            bar.advance()
            bar.describe("cold buffered pread")
            cold = raw.cold_read_gbps()
            bar.advance()
        finally:
            raw.close()
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fs = _filesystem(root.parent)
    nbytes = n * bb
    return [{"tier": "disk", "op": op, "block_bytes": bb, "blocks": n, "gbps": nbytes / p.a / 1e9,
             "baseline_gbps": nbytes / p.b / 1e9, **p.fields(),
             "cold_pread_gbps": cold if op == "get" else None,
             "io": io, "io_threads": args.io_threads, "filesystem": fs,
             "checksum_floor": floor.ratio if op == "put" else None}
            for op, p in (("put", p_put), ("get", p_get))]


class RawDisk:
    """The baseline: O_DIRECT pwritev/preadv of a file (created if missing) from/into one
    page-aligned buffer of the same size (each syscall its own `chunk`-byte region, as the
    tier's runs are), on `threads`."""

    def __init__(self, path, nbytes: int, chunk: int, threads: int) -> None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        from kvtier.tiers.memory import allocate_host

        self.path, self.nbytes, self.chunk, self.threads = path, nbytes, chunk, threads
        self.offsets = list(range(0, nbytes, chunk))
        self.buf = allocate_host(nbytes, pin=False)
        self.buf.array[:nbytes] = 7
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)   # the tier refuses less, too
        os.posix_fallocate(self.fd, 0, nbytes)
        self.pool = ThreadPoolExecutor(threads)

    def _each(self, fn) -> None:
        view = memoryview(self.buf.array)
        list(self.pool.map(lambda off: fn(view[off: min(off + self.chunk, self.nbytes)], off), self.offsets))

    def write(self, hash_rows: int | None = None) -> None:
        """The raw writes; with hash_rows, every hash_rows-byte block of the buffer is also
        hashed on this thread while they run (one C call, as the disk tier hashes a put)."""
        import os
        if hash_rows is None:
            self._each(lambda region, off: os.pwritev(self.fd, [region], off))
            return
        from kvtier.checksum import block_checksums
        view = memoryview(self.buf.array)
        futures = [self.pool.submit(os.pwritev, self.fd, [view[off: min(off + self.chunk, self.nbytes)]], off)
                   for off in self.offsets]
        a = self.buf.array
        block_checksums([a[i: i + hash_rows] for i in range(0, self.nbytes - hash_rows + 1, hash_rows)])
        for f in futures:
            f.result()

    def read(self) -> None:
        import os
        self._each(lambda region, off: os.preadv(self.fd, [region], off))

    def cold_read_gbps(self) -> float:
        """Buffered pread of the whole file after evicting it from the page cache."""
        import os
        import time

        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            off = 0
            while off < self.nbytes:
                off += len(os.pread(fd, self.chunk, off)) or self.nbytes
            return self.nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)

    def close(self) -> None:
        import os
        os.close(self.fd)
        self.pool.shutdown()
        self.buf.close()


def _filesystem(path) -> str:
    """The filesystem type holding `path`, from /proc/mounts (best match)."""
    import os

    best, fs = "", "unknown"
    try:
        target = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, kind = line.split()[:3]
                if target.startswith(mnt) and len(mnt) > len(best):
                    best, fs = mnt, f"{kind} ({dev})"
    except OSError:
        pass
    return fs
