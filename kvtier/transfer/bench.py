"""`kvtier bench tiers --tier device`: the transfer path against raw copies, in one run.

    gather / scatter   engine pages (vLLM layout, half the pages unused) <-> blocks,
                       against a plain contiguous copy of the same bytes on the device
    load / save        LayerLoader / Saver, host <-> device, against one raw copy of
                       the same bytes between pinned host memory and the device

On a machine without CUDA everything runs on the CPU (device "cpu"): the numbers then
measure the torch fallback against memcpy, not a GPU.
"""
from __future__ import annotations

from typing import Any


def bench_device(args: Any) -> list[dict]:
    """Rows like the host tier's (tier, op, block_bytes, gbps, baseline_gbps, ratio) plus
    blocks, device, impl and baseline. Reads args.block_bytes ("64KiB,1MiB"), args.total
    (bytes per timed operation, default 64MiB) and args.repeat, each optional."""
    import torch

    from kvtier.bench.common import quiet_threads
    from kvtier.units import parse_bytes

    quiet_threads()
    sizes = [parse_bytes(x) for x in (getattr(args, "block_bytes", None) or "64KiB,1MiB,4MiB").split(",")]
    total = parse_bytes(getattr(args, "total", None) or "64MiB")
    repeat = getattr(args, "repeat", None) or 5
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    rows = []
    for bb in sizes:
        rows += _one_size(bb, max(1, total // bb), repeat, device)
    return rows


def _one_size(bb: int, n: int, repeat: int, device) -> list[dict]:
    import torch

    from kvtier.bench.common import timeit_pair
    from kvtier.errors import ConfigError
    from kvtier.layout import KVLayout
    from kvtier.transfer import kernels
    from kvtier.transfer.pages import PagedKV
    from kvtier.transfer.streams import LayerLoader, Saver

    layers, block_tokens, page_tokens = 4, 32, 16
    if bb % (layers * 2 * block_tokens) or bb < 256:
        raise ConfigError(f"block size {bb} must be a positive multiple of 256 bytes for the device benchmark")
    layout = KVLayout.mha(layers, 1, bb // (layers * 2 * block_tokens), block_tokens, torch.uint8)
    cuda = device.type == "cuda"
    ppb = block_tokens // page_tokens
    num_pages = 2 * n * ppb
    g = torch.Generator().manual_seed(0)
    pages = [torch.randint(0, 256, (2, num_pages, page_tokens, 1, layout.head_dim), dtype=torch.uint8,
                           generator=g).to(device) for _ in range(layers)]
    table = torch.randperm(num_pages, generator=g)[: n * ppb].reshape(n, ppb)
    kv = PagedKV(pages, layout, "vllm")
    blocks = torch.empty(n, bb, dtype=torch.uint8, device=device)
    host = torch.empty(n, bb, dtype=torch.uint8, pin_memory=cuda)
    a = torch.randint(0, 256, (n * bb,), dtype=torch.uint8, generator=g).to(device)
    b = torch.empty_like(a)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn):
        def run() -> None:
            fn()
            sync()
        return run

    gather = timed(lambda: kv.gather(table, out=blocks))
    scatter = timed(lambda: kv.scatter(blocks, table))
    raw_dev = timed(lambda: b.copy_(a))
    t_gather, t_dev = timeit_pair(gather, raw_dev, repeat)
    t_scatter, t_dev2 = timeit_pair(scatter, raw_dev, repeat)

    host.copy_(blocks.cpu())
    loader, saver = LayerLoader(pages, layout, "vllm"), Saver(pages, layout, "vllm")
    load = timed(lambda: loader.load(host, table).wait())
    save = timed(lambda: saver.save(table, out=host).wait())
    raw_h2d = timed(lambda: blocks.view(-1).copy_(host.view(-1), non_blocking=True))
    raw_d2h = timed(lambda: host.view(-1).copy_(blocks.view(-1), non_blocking=True))
    t_load, t_h2d = timeit_pair(load, raw_h2d, repeat)
    t_save, t_d2h = timeit_pair(save, raw_d2h, repeat)

    # the bytes are right: the last save read exactly what the last load wrote
    assert torch.equal(host.to(device), kv.gather(table)), "device benchmark moved wrong bytes"
    name = f"{device} ({torch.cuda.get_device_name(device)})" if cuda else "cpu"
    impl = kernels.status() if cuda else "torch ops (no CUDA)"
    nbytes = n * bb
    out = []
    for op, t, t_raw, base in (("gather", t_gather, t_dev, "device copy"), ("scatter", t_scatter, t_dev2, "device copy"),
                               ("load", t_load, t_h2d, "pinned host->device copy" if cuda else "host memcpy"),
                               ("save", t_save, t_d2h, "device->pinned host copy" if cuda else "host memcpy")):
        out.append({"tier": "device", "op": op, "block_bytes": bb, "blocks": n, "gbps": nbytes / t / 1e9,
                    "baseline_gbps": nbytes / t_raw / 1e9, "ratio": t_raw / t, "device": name,
                    "impl": impl, "baseline": base})
    return out
