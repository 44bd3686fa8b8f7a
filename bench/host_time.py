"""Where a gather/scatter call's time goes on a GPU, beyond the copy: the host's work per call.

`kvtier bench tiers --tier device` times whole calls (`gather`, `scatter`: the page table
checked on the host and uploaded each call) and the copy with the table checked beforehand
(`gather_ids`, `scatter_ids`). On an H200 the copy was 0.87-0.90 of a device copy and the
whole call 0.53-0.67 at 64 KiB-4 MiB blocks. This splits a call: the check, the upload,
the launch, the kernel (CUDA events), each the median of 30 calls, in microseconds, with a
device copy of the same bytes as the baseline.

    python bench/host_time.py [--block-bytes 64KiB,1MiB] [--total 1GiB]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def median_us(fn: Callable[[], object], synced: bool = True, k: int = 30) -> float:
    """Median wall time of fn in us; synced: the GPU's work included (synchronize before and after)."""
    for _ in range(3):
        fn()
        torch.cuda.synchronize()
    out = []
    for _ in range(k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if synced:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1e6 * statistics.median(out)


def kernel_us(fn: Callable[[], object], k: int = 10) -> float:
    """Mean GPU time of fn's kernels in us (CUDA events around k calls)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(k):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / k


def one_size(block_bytes: int, total: int) -> dict[str, float]:
    from kvtier.layout import KVLayout
    from kvtier.transfer.pages import PagedKV, _check_ids, copy, upload

    layers, block_tokens, page_tokens = 4, 32, 16          # as bench tiers --tier device
    n, ppb = total // block_bytes, block_tokens // page_tokens
    layout = KVLayout.mha(layers, 1, block_bytes // (layers * 2 * block_tokens), block_tokens, torch.uint8)
    num_pages = 2 * n * ppb
    pages = [torch.zeros(2, num_pages, page_tokens, 1, layout.head_dim, dtype=torch.uint8, device="cuda")
             for _ in range(layers)]
    table = torch.randperm(num_pages)[: n * ppb].reshape(n, ppb)
    kv = PagedKV(pages, layout, "vllm")
    blocks = torch.empty(n, block_bytes, dtype=torch.uint8, device="cuda")
    ids = kv.table(table, unique=True)
    a = torch.ones(n * block_bytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    flat = table.reshape(-1).contiguous()
    return {
        "page ids": float(n * ppb),
        "device copy, synced": median_us(lambda: b.copy_(a)),
        "gather call, synced": median_us(lambda: kv.gather(table, out=blocks)),
        "scatter call, synced": median_us(lambda: kv.scatter(blocks, table)),
        "gather, ids checked, synced": median_us(lambda: copy(kv.views, ids, blocks, to_blocks=True)),
        "gather kernel (events)": kernel_us(lambda: copy(kv.views, ids, blocks, to_blocks=True)),
        "device copy kernel (events)": kernel_us(lambda: b.copy_(a)),
        "host: gather call": median_us(lambda: kv.gather(table, out=blocks), synced=False),
        "host: table()": median_us(lambda: kv.table(table), synced=False),
        "host: table(unique)": median_us(lambda: kv.table(table, unique=True), synced=False),
        "host: check_ids": median_us(lambda: _check_ids(flat.numpy(), num_pages, False, ppb), synced=False),
        "host: upload": median_us(lambda: upload(table, torch.device("cuda")), synced=False),
        "host: launch (ids checked)": median_us(lambda: copy(kv.views, ids, blocks, to_blocks=True), synced=False),
        "host: empty synchronize": median_us(lambda: None),
    }


def main() -> None:
    from kvtier.bench.common import check_block_sizes
    from kvtier.errors import KvtierError
    from kvtier.transfer.bench import BLOCK_MULTIPLE
    from kvtier.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-bytes", default="64KiB,1MiB")
    p.add_argument("--total", default="1GiB")
    args = p.parse_args()
    try:                                   # bad sizes are one line, as kvtier's own commands say them
        sizes, total = [parse_bytes(s) for s in args.block_bytes.split(",")], parse_bytes(args.total)
        check_block_sizes(sizes, total, BLOCK_MULTIPLE)
    except KvtierError as e:
        raise SystemExit(f"host_time.py: error: {e}") from None
    if not torch.cuda.is_available():
        raise SystemExit("host_time.py: error: needs a CUDA device")
    rows = {s: one_size(s, total) for s in sizes}
    print(f"{torch.cuda.get_device_name()}, medians in us, {args.total} per call")
    print(f"{'':32s}" + "".join(f"{s >> 10:>10d}K" for s in sizes))
    for name in rows[sizes[0]]:
        print(f"{name:32s}" + "".join(f"{rows[s][name]:11.1f}" for s in sizes))


if __name__ == "__main__":
    main()
