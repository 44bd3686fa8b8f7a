"""`kvtier bench adapter`: the path an engine takes between its KV pages and kvtier.

    save_from   the engine's pages (vLLM format, scattered page ids) -> the host tier
    load_into   the host tier -> the engine's pages, layer by layer, waited for
    load_host   pages in kvtier (the reference engine): a prefix in the host tier -> the
                device tier's pages, planned by the page pool
    load_disk   the same from the disk tier: read and verified, then copied into pages

Each is timed against the raw copy of the same bytes it stands for, in the same run,
alternating the two so both see the same machine. `--device cpu`: the engine's pages and
the device tier are CPU tensors, and the raw copy is a memcpy between two page-aligned host
buffers. `--device cuda` (the default when CUDA is here): they are on the GPU and the host
tier is pinned; the loads are timed against one pinned host->device copy, save_from against
one device->pinned host copy, and every timing ends with a device synchronize. A row's
`baseline` names its raw copy (its speed stays in `memcpy_gbps`). The default layout is
Llama-3-8B-like (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a token); the engine's
page is kvtier's block.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from kvtier import argtypes

if TYPE_CHECKING:
    import torch

    from kvtier.bench.common import Paired

HELP = ("time an engine's pages <-> kvtier's tiers (save_from, load_into, load from host and disk) against "
        "a raw copy of the same bytes (memcpy; pinned host<->device on a GPU)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-tokens", default="16,256",
                   help="comma-separated page sizes in tokens; a page is one kvtier block (default: %(default)s)")
    p.add_argument("--requests", type=argtypes.positive_int, default=2, help="requests moved per operation")
    p.add_argument("--prompt-tokens", type=argtypes.positive_int, default=4096, help="tokens per request")
    p.add_argument("--layers", type=argtypes.positive_int, default=32, help="model layers")
    p.add_argument("--kv-heads", type=argtypes.positive_int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=argtypes.positive_int, default=128, help="head dimension")
    p.add_argument("--repeat", type=argtypes.positive_int, default=9,
                   help="timed rounds, each the operation and its raw baseline: the median of the rounds' "
                        "ratios is reported, with a 90%% interval (default: 9)")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="where the load_disk row's disk tier goes (default: a temporary directory)")
    p.add_argument("--device", default=None,
                   help="where the engine's pages live: cuda:0 or cpu (default: cuda when present)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def page_sizes(text: str) -> list[int]:
    from kvtier.errors import ConfigError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--page-tokens {text!r}: give comma-separated whole numbers >= 1, e.g. 16,256")
    return sizes


def _device(text: str | None) -> torch.device:
    """--device as a torch.device (resolve_device: cuda:0 when CUDA is here, else cpu), its
    errors naming the option."""
    from kvtier.errors import ConfigError
    from kvtier.tiers.device import resolve_device

    try:
        return resolve_device(text)
    except ConfigError as e:
        raise ConfigError(f"--device {text}: {e} (on the command line: --device cpu, or leave --device out)") from None


def _device_name(device: torch.device) -> str:
    """What a row was measured on: "cuda:0 (NVIDIA H100 80GB HBM3)" or "cpu"."""
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu"


# Buffers of one operation's bytes the benchmark holds in host memory at once. On a CPU: the
# engine's pages (twice the pages the requests use), the host tier (two rounds of saves) and
# the memcpy's two. On a GPU the pages and the device tier are in its memory: the pinned host
# tier and the pinned baseline stay.
HOLDS = 6
HOLDS_WITH_GPU = 3


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.common import Column, emit, existing_dir, fmt_float, interval_column, memory_hint, quiet_threads
    from kvtier.progress import progress

    sizes = page_sizes(args.page_tokens)
    device = _device(args.device)
    args.disk = existing_dir("--disk", args.disk)
    _check_memory(args, HOLDS_WITH_GPU if device.type == "cuda" else HOLDS)
    quiet_threads()
    rows: list[dict[str, Any]] = []
    hint = "give fewer --requests, --prompt-tokens or --layers"
    with memory_hint(hint), progress("bench adapter", len(sizes), enabled=not args.json) as bar:
        for pt in sizes:
            bar.describe(f"{pt}-token pages")
            rows += _one_size(args, pt, device)
            rows += _pages_in_kvtier(args, pt, device)
            bar.advance()
    raw = "pinned host<->device copy" if device.type == "cuda" else "memcpy"
    emit(rows, args.json, f"Engine pages ({_device_name(device)}) <-> kvtier's tiers vs a raw {raw} of the same bytes "
         "(higher GB/s is better)",
         [Column("op", "op"), Column("page_tokens", "page tokens"), Column("blocks", "blocks"), Column("mib", "MiB"),
          Column("gbps", "GB/s", fmt_float(2)), Column("memcpy_gbps", "raw GB/s", fmt_float(2)),
          Column("ratio", "ratio", fmt_float(3)), interval_column()], left=1)
    return 0


def _check_memory(args: argparse.Namespace, holds: int) -> None:
    """Refuse, before allocating any of it, a run whose buffers this machine's memory cannot
    hold (touching them would bring the kernel's OOM killer, not an error)."""
    from kvtier.errors import ConfigError
    from kvtier.tiers.memory import memory_available
    from kvtier.units import format_bytes

    per_op = args.requests * args.prompt_tokens * args.layers * 2 * args.kv_heads * args.head_dim * 2   # bf16 K and V
    avail, _ = memory_available()
    if avail is not None and holds * per_op > avail:
        raise ConfigError(f"bench adapter holds about {holds} x {format_bytes(per_op)} (the bytes one operation "
                          f"moves), {format_bytes(holds * per_op)}, but this machine has {format_bytes(avail)} of "
                          "memory available: give fewer --requests, --prompt-tokens or --layers")


def _sizes(args: argparse.Namespace, page_tokens: int) -> tuple[Any, int]:
    """The layout of `page_tokens`-token blocks and how many blocks one operation moves."""
    import torch

    import kvtier

    layout = kvtier.KVLayout.mha(args.layers, args.kv_heads, args.head_dim, page_tokens, torch.bfloat16)
    n = args.requests * (args.prompt_tokens // page_tokens)
    if n < 1:
        from kvtier.errors import ConfigError
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens} holds no full {page_tokens}-token page")
    return layout, n


class _Raw(NamedTuple):
    """A raw copy of an op's bytes, timed against it, and its name in the rows."""

    name: str
    fn: Callable[[], object]


def _row(op: str, page_tokens: int, n: int, nbytes: int, p: Paired, device: str, raw: _Raw) -> dict[str, Any]:
    """`memcpy_gbps` is the baseline's speed whatever it is (`baseline`): the name rows always had."""
    return {"bench": "adapter", "op": op, "page_tokens": page_tokens, "blocks": n, "mib": round(nbytes / 2**20, 1),
            "gbps": round(nbytes / p.a / 1e9, 3), "memcpy_gbps": round(nbytes / p.b / 1e9, 3),
            **{k: round(v, 3) for k, v in p.fields().items()}, "device": device, "baseline": raw.name}


def _baselines(device: torch.device, nbytes: int) -> tuple[_Raw, _Raw, Callable[[], None]]:
    """The raw copies of `nbytes` an op is timed against: (into the engine's pages, out of
    them, the closer). On a CPU both are one memcpy; on a GPU, the DMA each way."""
    if device.type == "cuda":
        return (*_pinned_copies(device, nbytes), lambda: None)
    memcpy, close = _memcpy(nbytes)
    return _Raw("memcpy", memcpy), _Raw("memcpy", memcpy), close


def _memcpy(nbytes: int) -> tuple[Callable[[], object], Callable[[], None]]:
    """A raw memcpy of `nbytes` between two page-aligned, prefaulted buffers, and its closer."""
    from kvtier.tiers.memory import allocate_host

    src, dst = allocate_host(nbytes), allocate_host(nbytes)
    src.tensor[:] = 1

    def close() -> None:
        src.close()
        dst.close()
    return (lambda: dst.tensor.copy_(src.tensor)), close


def _pinned_copies(device: torch.device, nbytes: int) -> tuple[_Raw, _Raw]:
    """One copy of `nbytes` pinned host -> device and one device -> pinned host (the DMA a
    user compares with), each waited for. Pinned only here: pin_memory raises without CUDA."""
    import torch

    from kvtier.bench.common import synced

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)                                   # touched now, not in the first timing
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    return (_Raw("pinned host->device", synced(lambda: dev.copy_(host, non_blocking=True), device)),
            _Raw("device->pinned host", synced(lambda: host.copy_(dev, non_blocking=True), device)))


def _pages_in_kvtier(args: argparse.Namespace, page_tokens: int, device: torch.device) -> list[dict[str, Any]]:
    """An engine whose pages are the store's device tier (on `device`) loads a prefix found in
    the host tier, then one found on disk: adapter.lookup -> adapter.load (planned under the
    lock once, copied layer by layer into newly allocated pages) -> adapter.free. The blocks
    are not cache()d, so each round loads from the same tier again."""
    import shutil
    import tempfile

    import torch

    import kvtier
    from kvtier.adapter import KVAdapter
    from kvtier.bench.common import synced, timeit_pair

    layout, n = _sizes(args, page_tokens)
    nbytes = n * layout.block_bytes
    raw, _, close_raw = _baselines(device, nbytes)
    where = _device_name(device)
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-adapter-", dir=args.disk)
    rows = []
    try:
        for op, lower in (("load_host", kvtier.HostTier(blocks=n)), ("load_disk", kvtier.DiskTier(f"{tmp}/kv", blocks=n))):
            store = kvtier.Store(layout, [kvtier.DeviceTier(blocks=n, device=device), lower],
                                 kvtier.Namespace("bench-adapter", "r1"), promote=False)
            adapter = KVAdapter(store)
            try:
                tokens = torch.arange(n * page_tokens)
                keys = adapter.keys(tokens)
                rows_in = torch.randint(0, 255, (n, layout.block_bytes), dtype=torch.uint8)
                store.put(keys, rows_in)                      # into the device tier...
                adapter.free(adapter.allocate(n) or [])       # ...and evicted down, all of it
                assert adapter.lookup(tokens).tiers == [lower.name] * n

                def load() -> None:
                    got = adapter.load(adapter.lookup(tokens))
                    got.wait()
                    assert got.blocks == n, f"only {got.blocks} of {n} blocks loaded"
                    adapter.free(got.pages)

                p = timeit_pair(synced(load, device), raw.fn, args.repeat)
                rows.append(_row(op, page_tokens, n, nbytes, p, where, raw))
            finally:
                adapter.close()
                store.close()
    finally:
        close_raw()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _one_size(args: argparse.Namespace, page_tokens: int, device: torch.device) -> list[dict[str, Any]]:
    """An engine that owns its pages (on `device`) saves them into the host tier and loads
    them back: adapter.save_from / adapter.load_into, each waited for."""
    import torch

    import kvtier
    from kvtier.adapter import KVAdapter
    from kvtier.bench.common import synced, timeit_pair
    from kvtier.transfer.pages import PagedKV

    layout, n = _sizes(args, page_tokens)
    nbytes = n * layout.block_bytes
    # The engine's pages: twice the pages the requests use, the used ones scattered (as in a busy engine).
    g = torch.Generator().manual_seed(0)
    num_pages = 2 * n
    shape = (2, num_pages, page_tokens, args.kv_heads, args.head_dim)
    pages = [torch.randn(shape, generator=g).to(device, torch.bfloat16) for _ in range(args.layers)]
    table = torch.randperm(num_pages, generator=g)[:n].reshape(n, 1)
    paged = PagedKV(pages, layout, "vllm")
    # Room for two rounds of saves, so a timed save evicts (as a full store does) but never fails.
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=2 * n + 1)], kvtier.Namespace("bench-adapter", "r1"))
    adapter = KVAdapter(store)
    load_raw, save_raw, close_raw = _baselines(device, nbytes)
    where = _device_name(device)
    rounds = [0]

    def save() -> None:          # fresh tokens each time: a save of blocks already cached does nothing
        rounds[0] += 1
        keys = adapter.keys(torch.arange(n * page_tokens) + rounds[0] * 1_000_003)
        adapter.save_from(keys, paged, table).wait()

    load_keys = adapter.keys(torch.arange(n * page_tokens))
    adapter.save_from(load_keys, paged, table).wait()

    def load() -> None:
        got = adapter.load_into(load_keys, paged, table).wait()
        assert got == n, f"only {got} of {n} blocks loaded"

    rows = []
    try:
        # Loads first: saves evict their blocks.
        for op, fn, raw in (("load_into", load, load_raw), ("save_from", save, save_raw)):
            p = timeit_pair(synced(fn, device), raw.fn, args.repeat)
            rows.append(_row(op, page_tokens, n, nbytes, p, where, raw))
    finally:
        adapter.close()
        store.close()
        close_raw()
    return rows
