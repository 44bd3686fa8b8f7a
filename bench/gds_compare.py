"""Disk -> GPU memory: GPUDirect Storage (kvikio / cuFile) against O_DIRECT into pinned host
memory plus one host-to-device copy, the same bytes, alternated in one run.

    python bench/gds_compare.py [--dir DIR] [--total 1GiB] [--threads 4] [--repeat 7]

Needs a CUDA GPU and kvikio (`pip install kvikio-cu13`, or kvikio-cu12 for CUDA 12). Prints
one JSON row per line: the read's GB/s, the baseline's, their paired ratio with a 90%
interval, and the mode kvikio actually used. Where the kernel lacks nvidia-fs (containers,
VMs) kvikio and cuFile fall back to a compatibility mode: POSIX reads through a bounce
buffer, not DMA from the drive. The row says so; treat such a figure as that, not as GDS.
The page cache is dropped for the file before every timed read (posix_fadvise), so neither
side reads from memory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 4 << 20          # bytes per O_DIRECT read request (the disk tier's default block size)


def _mode(kvikio: Any) -> dict[str, str]:
    """What kvikio reports about its own and cuFile's modes (names vary across versions)."""
    out: dict[str, str] = {"kvikio": getattr(kvikio, "__version__", "?")}
    for name, get in (("compat_mode", lambda: kvikio.defaults.get("compat_mode")),
                      ("compat_mode", lambda: kvikio.defaults.compat_mode()),
                      ("gds_available", lambda: kvikio.cufile_driver.get("is_gds_available")),
                      ("gds_available", lambda: kvikio.is_gds_available())):
        if name in out:
            continue
        try:
            out[name] = str(get())
        except Exception as e:        # an API this version lacks: say which
            out.setdefault(name + "_error", f"{type(e).__name__}: {e}"[:120])
    return out


def _device_buffer(t: Any) -> Any:
    """The tensor as kvikio takes it: through __cuda_array_interface__, as a CuPy view if present."""
    try:
        import cupy
        return cupy.asarray(t)
    except ImportError:
        return t


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> int:
    import torch

    from kvtier import argtypes
    from kvtier.bench.common import timeit_pair

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the test file goes (default: a temporary directory)")
    p.add_argument("--total", type=argtypes.size, default="1GiB", help="bytes per timed read (at least 4MiB)")
    p.add_argument("--threads", type=argtypes.positive_int, default=4, help="I/O threads for both sides")
    p.add_argument("--repeat", type=argtypes.positive_int, default=7)
    args = p.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir}: not an existing directory")
    if args.total < CHUNK:
        p.error(f"--total must be at least {CHUNK >> 20}MiB (one read request)")
    if not torch.cuda.is_available():
        print("gds_compare: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import kvikio
        import kvikio.cufile_driver  # noqa: F401  (for _mode)
        import kvikio.defaults  # noqa: F401  (a submodule: `import kvikio` alone does not load it)
    except ImportError as e:
        print(f"gds_compare: error: kvikio is not importable ({e}): pip install kvikio-cu13", file=sys.stderr)
        return 2
    total = args.total // CHUNK * CHUNK
    try:
        kvikio.defaults.set("num_threads", args.threads)
    except Exception:
        pass
    with tempfile.TemporaryDirectory(prefix="kvtier-gds-", dir=args.dir) as tmp:
        path = f"{tmp}/blocks.bin"
        data = torch.randint(0, 256, (total,), dtype=torch.uint8)
        with open(path, "wb") as f:
            f.write(data.numpy().tobytes())
            f.flush()
            os.fsync(f.fileno())
        dev_gds = torch.empty(total, dtype=torch.uint8, device="cuda")
        dev_raw = torch.empty_like(dev_gds)
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        view = memoryview(pinned.numpy())
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        pool = ThreadPoolExecutor(args.threads)
        cf = kvikio.CuFile(path, "r")
        target = _device_buffer(dev_gds)

        def gds() -> None:
            _drop_cache(path)
            n = cf.pread(target, total, 0).get()
            assert n == total, f"kvikio read {n} of {total} bytes"

        def read_chunk(off: int) -> None:
            got = os.preadv(fd, [view[off:off + CHUNK]], off)
            assert got == CHUNK, f"short O_DIRECT read at {off}: {got}"

        def raw() -> None:
            _drop_cache(path)
            list(pool.map(read_chunk, range(0, total, CHUNK)))
            dev_raw.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        pair = timeit_pair(gds, raw, args.repeat)
        assert torch.equal(dev_gds, dev_raw) and torch.equal(dev_gds.cpu(), data), "the two reads disagree"
        cf.close()
        os.close(fd)
        pool.shutdown()
    row = {"bench": "gds", "op": "disk->device", "bytes": total, "threads": args.threads,
           "gbps": round(total / pair.a / 1e9, 3), "baseline_gbps": round(total / pair.b / 1e9, 3),
           "baseline": "O_DIRECT into pinned host + one H2D copy",
           **{k: round(v, 3) for k, v in pair.fields().items()},
           "device": torch.cuda.get_device_name(0), **_mode(kvikio)}
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
