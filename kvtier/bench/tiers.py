"""Tier put/get bandwidth against a raw copy of the same bytes, in the same run.

host: a raw memcpy between page-aligned buffers.
disk: raw O_DIRECT pwritev/preadv of the same bytes with the tier's thread count and
bytes per syscall (so the ratio is the tier's overhead, not its parallelism), and a
buffered pread of a cold file.
"""
from __future__ import annotations

import argparse

HELP = "time put and get of blocks through a tier against a raw copy of the same bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier", default="host", choices=["host", "disk", "device"], help="tier to measure (default host)")
    p.add_argument("--block-bytes", default=None,
                   help="comma-separated block sizes (default 64KiB,1MiB,4MiB for host, 1MiB,4MiB for disk)")
    p.add_argument("--total", default=None, help="bytes moved per timed operation (default 256MiB host, 512MiB disk)")
    p.add_argument("--path", default=None, help="disk: directory for the slab files (default: a temp dir)")
    p.add_argument("--io-threads", type=int, default=4, help="disk: I/O threads, for the tier and the baseline")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions; the median is reported")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import emit, quiet_threads
    from kvtier.units import parse_bytes

    quiet_threads()
    if args.tier == "device":
        from kvtier.transfer.bench import bench_device
        emit(bench_device(args), args.json, "kvtier bench tiers --tier device (baseline: plain device copy / "
             "raw pinned host<->device copy)",
             ["tier", "op", "block_bytes", "gbps", "baseline_gbps", "ratio", "device", "impl", "baseline"])
        return 0
    disk = args.tier == "disk"
    sizes = [parse_bytes(x) for x in (args.block_bytes or ("1MiB,4MiB" if disk else "64KiB,1MiB,4MiB")).split(",")]
    total = parse_bytes(args.total or ("512MiB" if disk else "256MiB"))
    rows = []
    for bb in sizes:
        rows += _disk(bb, total, args) if disk else _host(bb, total, args)
    cols = ["tier", "op", "block_bytes", "gbps", "baseline_gbps", "ratio"]
    cols += ["cold_pread_gbps", "io", "filesystem"] if disk else ["memory"]
    emit(rows, args.json, f"kvtier bench tiers --tier {args.tier} (baseline: "
         + ("raw O_DIRECT, same threads and bytes per syscall)" if disk else "raw memcpy, page-aligned)"), cols)
    return 0


def _layout(bb: int):
    import torch

    from kvtier.errors import ConfigError
    from kvtier.layout import KVLayout

    if bb % 32 or bb < 32:
        raise ConfigError(f"block size {bb} must be a positive multiple of 32 bytes")
    return KVLayout.mha(1, 1, bb // 32, 16, torch.uint8)   # one layer, one head: exactly bb bytes


def _put_get(store, n: int, bb: int, repeat: int, raw_put=None, raw_get=None) -> tuple[float, ...]:
    """Median seconds of a put of n fresh blocks (evicting the last round) and of a get of n
    blocks; with raw_put/raw_get, also of those, each alternated with the tier's op."""
    import numpy as np
    import torch

    from kvtier.bench.common import timeit, timeit_pair
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

    if raw_put is None:
        t_put = timeit(put, repeat)
        store.put(keys, src)
        t_get = timeit(get, repeat)
        times: tuple[float, ...] = (t_put, t_get)
    else:
        t_put, t_raw_put = timeit_pair(put, raw_put, repeat)
        store.put(keys, src)
        t_get, t_raw_get = timeit_pair(get, raw_get, repeat)
        times = (t_put, t_get, t_raw_put, t_raw_get)
    assert torch.equal(out, src), "get returned different bytes than put"
    return times


def _host(bb: int, total: int, args) -> list[dict]:
    import numpy as np

    from kvtier.bench.common import timeit
    from kvtier.keys import Namespace
    from kvtier.store import Store
    from kvtier.tiers import HostTier
    from kvtier.tiers.memory import allocate_host

    n = max(1, total // bb)
    store = Store(_layout(bb), [HostTier(blocks=n)], Namespace("bench"))
    t_put, t_get = _put_get(store, n, bb, args.repeat)
    a = allocate_host(n * bb).array[: n * bb]
    a[:] = 7
    b = allocate_host(n * bb).array[: n * bb]
    raw = n * bb / timeit(lambda: np.copyto(b, a), args.repeat) / 1e9
    memory = store.stats().tiers[0].info.get("memory")
    store.close()
    return [{"tier": "host", "op": op, "block_bytes": bb, "blocks": n, "gbps": n * bb / t / 1e9,
             "baseline_gbps": raw, "ratio": n * bb / t / 1e9 / raw, "memory": memory}
            for op, t in (("put", t_put), ("get", t_get))]


def _disk(bb: int, total: int, args) -> list[dict]:
    import shutil
    import tempfile
    from pathlib import Path

    from kvtier.keys import Namespace
    from kvtier.store import Store
    from kvtier.tiers import DiskTier

    n = max(1, total // bb)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.path))
    try:
        tier = DiskTier(root / "tier", blocks=n, io_threads=args.io_threads)
        store = Store(_layout(bb), [tier], Namespace("bench"))
        chunk = tier._chunk_slots * tier.slot_bytes   # the tier's bytes per syscall
        io = tier.info()["io"]
        raw = RawDisk(root / "raw.bin", n * tier.slot_bytes, chunk, args.io_threads)
        try:
            t_put, t_get, t_raw_w, t_raw_r = _put_get(store, n, bb, args.repeat, raw.write, raw.read)
            cold = raw.cold_read_gbps()
        finally:
            raw.close()
            store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fs = _filesystem(root.parent)
    nbytes = n * bb
    return [{"tier": "disk", "op": op, "block_bytes": bb, "blocks": n, "gbps": nbytes / t / 1e9,
             "baseline_gbps": nbytes / t_raw / 1e9, "ratio": t_raw / t,
             "cold_pread_gbps": cold if op == "get" else None,
             "io": io, "io_threads": args.io_threads, "filesystem": fs}
            for op, t, t_raw in (("put", t_put, t_raw_w), ("get", t_get, t_raw_r))]


class RawDisk:
    """The baseline: O_DIRECT pwritev/preadv of a file from/into one page-aligned buffer of the
    same size (each syscall its own `chunk`-byte region, as the tier's runs are), on `threads`."""

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

    def write(self) -> None:
        import os
        self._each(lambda region, off: os.pwritev(self.fd, [region], off))

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
