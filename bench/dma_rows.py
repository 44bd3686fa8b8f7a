"""Host <-> GPU 2D DMA by row width: how fast `kernels.copy_2d` moves rows of W bytes at a
pitch of 4 W (one layer of 4-layer layer-major blocks), against one flat pinned copy of the
same bytes, paired, in one run. It is the measurement behind streams.MIN_DMA_ROW: below
some width a strided DMA is slower than a flat copy, so layers cross the link in groups.

    python bench/dma_rows.py [--total 1GiB] [--widths 4KiB,16KiB,64KiB,256KiB,1MiB] [--repeat 9]

Needs a CUDA GPU and the kvtier extension (nvcc and ninja at run time). One JSON row per
line: direction, width, GB/s of the 2D DMA and of the flat copy, and the paired ratio with
its 90% interval (kvtier.bench.common.Paired).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PITCH_LAYERS = 4     # row pitch = 4 x width: one layer of a 4-layer block


def main(argv: list[str] | None = None) -> int:
    from kvtier.argtypes import positive_int, size
    from kvtier.bench.common import quiet_threads, size_list, synced, timeit_pair

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=size, default=size("1GiB"), help="bytes per timed copy")
    p.add_argument("--widths", type=size_list, default=size_list("4KiB,16KiB,64KiB,256KiB,1MiB"))
    p.add_argument("--repeat", type=positive_int, default=9)
    args = p.parse_args(argv)
    if args.total < max(args.widths):
        p.error("--total must be at least the widest row")

    import torch

    from kvtier.transfer import kernels
    if not torch.cuda.is_available() or kernels.load() is None:
        p.error(f"needs a CUDA GPU and the kvtier extension ({kernels.status()})")
    quiet_threads()
    dev = torch.device("cuda:0")
    for w in args.widths:
        rows = args.total // w
        host = torch.empty(rows * w * PITCH_LAYERS, dtype=torch.uint8, pin_memory=True)
        host[::4096] = 1                                           # touch every page once
        flat_host = host[: rows * w]
        gpu = torch.empty(rows * w, dtype=torch.uint8, device=dev)
        pitch = w * PITCH_LAYERS
        cases = {
            "h2d": (lambda: kernels.copy_2d(gpu, 0, w, host, w, pitch, w, rows),
                    lambda: gpu.copy_(flat_host, non_blocking=True)),
            "d2h": (lambda: kernels.copy_2d(host, w, pitch, gpu, 0, w, w, rows),
                    lambda: flat_host.copy_(gpu, non_blocking=True)),
        }
        for direction, (dma, flat) in cases.items():
            pair = timeit_pair(synced(dma, dev), synced(flat, dev), args.repeat)
            nbytes = rows * w
            print(json.dumps({"direction": direction, "width": w, "rows": rows, "dma_gbps": nbytes / pair.a / 1e9,
                              "flat_gbps": nbytes / pair.b / 1e9, **pair.fields(),
                              "device": torch.cuda.get_device_name(dev)}), flush=True)
        del host, gpu
    return 0


if __name__ == "__main__":
    sys.exit(main())
