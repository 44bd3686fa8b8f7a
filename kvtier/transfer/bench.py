"""`kvtier bench tiers --tier device`: the transfer path against raw copies, in one run.

    gather / scatter   engine pages (vLLM layout, half the pages unused) <-> blocks,
                       against a plain contiguous copy of the same bytes on the device
    gather_ids / scatter_ids
                       the same with the block table already checked and on the device
                       (pages.copy): the copy alone, without the per-call table check
                       and upload that gather/scatter do first
    load / save        LayerLoader / Saver, host <-> device, against one raw copy of
                       the same bytes between pinned host memory and the device

On a machine without CUDA everything runs on the CPU (device "cpu"): the numbers then
measure the torch fallback against memcpy, not a GPU.
"""
from __future__ import annotations

from typing import Any

from kvtier.progress import Progress

# Block sizes must be whole multiples of the benchmark's layout: 4 layers x K,V x 32 tokens.
BLOCK_MULTIPLE = 256


def bench_device(args: Any, bar: Progress | None = None) -> list[dict]:
    """Rows like the host tier's (tier, op, block_bytes, gbps, baseline_gbps, ratio) plus
    blocks, device, impl and baseline. Reads args.block_bytes (a list of sizes, or a string
    like "64KiB,1MiB"), args.total (bytes per timed operation, default 1GiB on a GPU, 64MiB on a
    CPU: an H100 copies 64 MiB in about 60 us, so a smaller op would time the call, not the copy) and
    args.repeat (default 5), each optional; `bar` advances by one per timed op."""
    import torch

    from kvtier.bench.common import check_block_sizes, quiet_threads
    from kvtier.units import parse_bytes

    quiet_threads()
    sizes = getattr(args, "block_bytes", None) or "64KiB,1MiB,4MiB"
    if isinstance(sizes, str):
        sizes = [parse_bytes(x) for x in sizes.split(",")]
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    total = parse_bytes(getattr(args, "total", None) or ("1GiB" if device.type == "cuda" else "64MiB"))
    repeat = getattr(args, "repeat", None)
    repeat = 5 if repeat is None else repeat
    check_block_sizes(sizes, total, BLOCK_MULTIPLE)
    bar = bar or Progress()
    rows = []
    for bb in sizes:
        rows += _one_size(bb, total // bb, repeat, device, bar)
    return rows


def _one_size(bb: int, n: int, repeat: int, device, bar: Progress) -> list[dict]:
    import torch

    from kvtier.bench.common import fmt_size, synced, timeit_pair
    from kvtier.errors import ConfigError
    from kvtier.layout import KVLayout
    from kvtier.transfer import kernels
    from kvtier.transfer.pages import PagedKV, copy
    from kvtier.transfer.streams import LayerLoader, Saver

    layers, block_tokens, page_tokens = 4, 32, 16
    if bb % BLOCK_MULTIPLE or bb < BLOCK_MULTIPLE:
        raise ConfigError(f"block size {bb} must be a positive multiple of {BLOCK_MULTIPLE} bytes for the device "
                          "benchmark")
    layout = KVLayout.mha(layers, 1, bb // (layers * 2 * block_tokens), block_tokens, torch.uint8)
    cuda = device.type == "cuda"
    ppb = block_tokens // page_tokens
    num_pages = 2 * n * ppb
    g = torch.Generator().manual_seed(0)
    gd = torch.Generator(device).manual_seed(0)     # the bytes drawn where they live: GiBs on a GPU
    pages = [torch.randint(0, 256, (2, num_pages, page_tokens, 1, layout.head_dim), dtype=torch.uint8,
                           generator=gd, device=device) for _ in range(layers)]
    table = torch.randperm(num_pages, generator=g)[: n * ppb].reshape(n, ppb)
    kv = PagedKV(pages, layout, "vllm")
    blocks = torch.empty(n, bb, dtype=torch.uint8, device=device)
    host = torch.empty(n, bb, dtype=torch.uint8, pin_memory=cuda)
    a = torch.randint(0, 256, (n * bb,), dtype=torch.uint8, generator=gd, device=device)
    b = torch.empty_like(a)
    def timed(fn):
        return synced(fn, device)

    ids = kv.table(table, unique=True)
    host.copy_(blocks.cpu())
    loader, saver = LayerLoader(pages, layout, "vllm"), Saver(pages, layout, "vllm")
    raw_dev = ("device copy", timed(lambda: b.copy_(a)))
    raw_h2d = ("pinned host->device" if cuda else "host memcpy",
               timed(lambda: blocks.view(-1).copy_(host.view(-1), non_blocking=True)))
    raw_d2h = ("device->pinned host" if cuda else "host memcpy",
               timed(lambda: host.view(-1).copy_(blocks.view(-1), non_blocking=True)))
    ops = (  # (row, what the bar says, the operation, its raw baseline)
        ("gather", "gather", lambda: kv.gather(table, out=blocks), raw_dev),
        ("scatter", "scatter", lambda: kv.scatter(blocks, table), raw_dev),
        ("gather_ids", "gather, table checked", lambda: copy(kv.views, ids, blocks, to_blocks=True), raw_dev),
        ("scatter_ids", "scatter, table checked", lambda: copy(kv.views, ids, blocks, to_blocks=False), raw_dev),
        ("load", "load", lambda: loader.load(host, table).wait(), raw_h2d),
        ("save", "save", lambda: saver.save(table, out=host).wait(), raw_d2h),
    )
    what = f"device, {fmt_size(bb)} blocks"
    name = f"{device} ({torch.cuda.get_device_name(device)})" if cuda else "cpu"
    impl = kernels.status() if cuda else "torch ops (no CUDA)"
    nbytes = n * bb
    out = []
    for op, says, fn, (base, raw) in ops:
        bar.describe(f"{what}: {says}")
        p = timeit_pair(timed(fn), raw, repeat)
        bar.advance()
        out.append({"tier": "device", "op": op, "block_bytes": bb, "blocks": n, "gbps": nbytes / p.a / 1e9,
                    "baseline_gbps": nbytes / p.b / 1e9, **p.fields(), "device": name,
                    "impl": impl, "baseline": base})
    # the bytes are right: the last save read exactly what the last load wrote
    assert torch.equal(host.to(device), kv.gather(table)), "device benchmark moved wrong bytes"
    loader.close()
    return out
