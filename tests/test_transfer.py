"""Transfer path: engine pages <-> kvtier blocks, byte-exact, with every bad input refused
before a byte moves; the layer loader and saver on a CPU; the CUDA kernel compiles.

GPU tests (kernel vs torch fallback, copy/compute overlap) are marked `gpu` and skipped
without CUDA: on the machine this was written on they never ran (docs/gpu.md).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import LayoutError
from kvtier.layout import KVLayout
from kvtier.transfer import LayerLoader, PagedKV, Saver, gather, scatter
from kvtier.transfer import kernels

torch.set_num_threads(1)
CSRC = Path(__file__).resolve().parents[1] / "csrc"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8]
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False): "
                                           "run on a GPU machine, see docs/gpu.md")


def random_pages(fmt: str, layout: KVLayout, num_pages: int, page_tokens: int, seed: int,
                 device: str = "cpu") -> list[torch.Tensor]:
    """Random bytes (NaN patterns included) viewed as the layout's dtype, one tensor per layer."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "vllm":
        shape = (2, num_pages, page_tokens, layout.num_kv_heads, layout.head_dim)
    elif fmt == "flashinfer":
        shape = (num_pages, 2, page_tokens, layout.num_kv_heads, layout.head_dim)
    else:
        shape = (num_pages, page_tokens, layout.kv_lora_rank + layout.rope_dim)
    out = []
    for _ in range(layout.num_layers):
        n = 1
        for d in shape:
            n *= d
        raw = torch.randint(0, 256, (n * layout.itemsize,), dtype=torch.uint8, generator=g)
        out.append(raw.view(layout.dtype).reshape(shape).to(device))
    return out


def expected_blocks(fmt: str, layout: KVLayout, pages: list[torch.Tensor], table: list[list[int]]) -> torch.Tensor:
    """The definition, written independently of the code under test: block b, layer l is
    K then V (MHA) or the latent (MLA), each the block's pages concatenated in token order."""
    blocks = []
    for row in table:
        layers = []
        for t in pages:
            if fmt == "vllm":
                layer = torch.stack([torch.cat([t[0, p] for p in row]), torch.cat([t[1, p] for p in row])])
            elif fmt == "flashinfer":
                layer = torch.stack([torch.cat([t[p, 0] for p in row]), torch.cat([t[p, 1] for p in row])])
            else:
                layer = torch.cat([t[p] for p in row])
            assert tuple(layer.shape) == layout.layer_shape
            layers.append(layer.contiguous().view(torch.uint8).reshape(-1))
        blocks.append(torch.cat(layers))
    return torch.stack(blocks) if blocks else torch.empty(0, layout.block_bytes, dtype=torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(["vllm", "flashinfer", "mla"]))
    dtype = draw(st.sampled_from(DTYPES))
    page_tokens = draw(st.sampled_from([1, 2, 4]))
    ppb = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    if fmt == "mla":
        layout = KVLayout.mla(layers, draw(st.integers(1, 6)), draw(st.integers(1, 3)), page_tokens * ppb, dtype)
    else:
        layout = KVLayout.mha(layers, draw(st.integers(1, 3)), draw(st.integers(1, 5)), page_tokens * ppb, dtype)
    num_pages = draw(st.integers(1, 12))
    n_blocks = draw(st.integers(0, 5))
    # gather: any pages, repeats allowed
    table = [[draw(st.integers(0, num_pages - 1)) for _ in range(ppb)] for _ in range(n_blocks)]
    # scatter: distinct pages, leaving holes (pages no block names)
    k = min(n_blocks, num_pages // ppb)
    distinct = draw(st.permutations(range(num_pages)))[: k * ppb]
    unique = [distinct[i * ppb:(i + 1) * ppb] for i in range(k)]
    return fmt, layout, page_tokens, num_pages, table, unique, draw(st.integers(0, 2**31))


@given(cases())
@settings(max_examples=150, deadline=None)
def test_gather_scatter_round_trip_byte_exact(case):
    fmt, layout, page_tokens, num_pages, table, unique, seed = case
    pages = random_pages(fmt, layout, num_pages, page_tokens, seed)
    # gather (repeats allowed) equals the definition
    ppb = layout.block_tokens // page_tokens
    got = gather(pages, torch.tensor(table, dtype=torch.int32).reshape(len(table), ppb), layout, fmt)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (len(table), layout.block_bytes)
    assert torch.equal(got, expected_blocks(fmt, layout, pages, table))
    # the torch fallback (no C module) gives the same bytes as the C loop `auto` uses on a CPU
    assert torch.equal(gather(pages, table if table else torch.empty(0, ppb, dtype=torch.int64), layout, fmt,
                              impl="torch"), got)
    # scatter into a fresh cache: named pages get the bytes, holes keep their old bytes
    blocks = gather(pages, unique if unique else torch.empty(0, ppb, dtype=torch.int64), layout, fmt)
    dst = random_pages(fmt, layout, num_pages, page_tokens, seed + 1)
    before = [as_bytes(t).clone() for t in dst]
    if unique:
        scatter(blocks, dst, unique, layout, fmt)
    named = {p for row in unique for p in row}
    for l in range(layout.num_layers):
        for p in range(num_pages):
            src = pages[l][:, p] if fmt == "vllm" else pages[l][p]
            new = dst[l][:, p] if fmt == "vllm" else dst[l][p]
            old = before[l].view(layout.dtype)[:, p] if fmt == "vllm" else before[l].view(layout.dtype)[p]
            assert torch.equal(as_bytes(new), as_bytes(src if p in named else old)), (l, p)
    # and gathering the scattered pages gives the blocks back
    if unique:
        assert torch.equal(gather(dst, unique, layout, fmt), blocks)
        dst2 = random_pages(fmt, layout, num_pages, page_tokens, seed + 1)
        scatter(blocks, dst2, unique, layout, fmt, impl="torch")
        assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(dst, dst2))


def test_native_chunk_copy_checks_every_offset_first():
    copy_chunks = pytest.importorskip("kvtier._copy").copy_chunks
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    copy_chunks(dst, np.array([0, 56], dtype=np.int64), src, np.array([8, 0], dtype=np.int64), 8)
    assert list(dst[:8]) == list(range(8, 16)) and list(dst[56:]) == list(range(8))
    dst[:] = 0
    for d, s in (([0, 57], [0, 0]), ([0, 0], [-1, 0]), ([0], [0, 8])):
        with pytest.raises(ValueError):
            copy_chunks(dst, np.array(d, dtype=np.int64), src, np.array(s, dtype=np.int64), 8)
    assert not dst.any()          # a bad call moved nothing
    with pytest.raises(TypeError):
        copy_chunks(src.tobytes(), np.zeros(1, dtype=np.int64), src, np.zeros(1, dtype=np.int64), 8)   # read-only dst


def mha_case(fmt="vllm"):
    layout = KVLayout.mha(2, 2, 4, 8, torch.float16)         # 2 pages of 4 tokens per block
    return layout, random_pages(fmt, layout, 10, 4, 0)


BAD = {
    "page out of range": lambda L, p: dict(table=[[0, 10]]),
    "negative page": lambda L, p: dict(table=[[-1, 2]]),
    "table width": lambda L, p: dict(table=[[0, 1, 2]]),
    "float table": lambda L, p: dict(table=torch.tensor([[0.0, 1.0]])),
    "dtype mismatch": lambda L, p: dict(pages=[t.float() for t in p]),
    "wrong shape": lambda L, p: dict(pages=[t[:, :, :, :1] for t in p]),
    "layers differ": lambda L, p: dict(pages=[p[0], p[1][:, :5]]),
    "layer count": lambda L, p: dict(pages=p[:1]),
    "layers on two devices": lambda L, p: dict(pages=[p[0], p[1].to("meta")]),
    "not contiguous": lambda L, p: dict(pages=[t.transpose(3, 4).contiguous().transpose(3, 4) if i else t
                                              for i, t in enumerate(p)]),
    "page format vs layout": lambda L, p: dict(fmt="mla"),
    "unknown format": lambda L, p: dict(fmt="paged"),
    "block_tokens not whole pages": lambda L, p: dict(pages=[torch.zeros(2, 10, 3, 2, 4, dtype=torch.float16)] * 2),
    "blocks dtype": lambda L, p: dict(blocks=torch.zeros(1, L.block_bytes, dtype=torch.int8)),
    "blocks shape": lambda L, p: dict(blocks=torch.zeros(1, L.block_bytes + 1, dtype=torch.uint8)),
    "blocks on meta device": lambda L, p: dict(blocks=torch.empty(1, L.block_bytes, dtype=torch.uint8, device="meta")),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_input_raises_before_any_copy(what):
    layout, pages = mha_case()
    args = dict(pages=pages, table=[[3, 4]], fmt="vllm",
                blocks=torch.full((1, layout.block_bytes), 7, dtype=torch.uint8))
    args.update(BAD[what](layout, pages))
    snapshot = [as_bytes(t).clone() for t in args["pages"]]
    with pytest.raises(LayoutError) as e:
        scatter(args["blocks"], args["pages"], args["table"], layout, args["fmt"])
    assert len(str(e.value)) > 40       # says what was wrong and what to do
    for t, s in zip(args["pages"], snapshot):
        if t.device.type == "cpu":
            assert torch.equal(as_bytes(t), s), "scatter changed the pages before refusing"
    if "blocks" not in what:
        out = torch.full((1, layout.block_bytes), 9, dtype=torch.uint8)
        with pytest.raises(LayoutError):
            gather(args["pages"], args["table"], layout, args["fmt"], out=out)
        assert bool((out == 9).all()), "gather wrote into out before refusing"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 40), min_size=1, max_size=60), st.integers(1, 40), st.booleans())
def test_table_check_in_c_matches_the_numpy_check(ids, num_pages, unique):
    """kvtier._copy.check_ids (one pass) refuses exactly what the numpy fallback refuses, and
    names the same kind of fault (a page out of range, or a page written twice)."""
    from kvtier.transfer import pages as P
    if P._check_ids_c is None:
        pytest.skip("kvtier._copy is not built (no C compiler at install)")
    flat = np.array(ids, dtype=np.int64)

    def outcome(check_c):
        saved, P._check_ids_c = P._check_ids_c, check_c
        try:
            P._check_ids(flat, num_pages, unique, 1)
            return "ok"
        except LayoutError as e:
            return "range" if "names page" in str(e) else "repeat"
        finally:
            P._check_ids_c = saved
    want = ("range" if flat.min() < 0 or flat.max() >= num_pages
            else "repeat" if unique and len(set(ids)) < len(ids) else "ok")
    assert outcome(P._check_ids_c) == outcome(None) == want


def test_a_table_handed_on_as_checked_must_be_the_caches_own_form():
    """checked=True skips the per-id check (the adapter checked the table already), not the
    form: a raw list, another dtype or another width is refused before a byte moves."""
    layout, pages = mha_case()
    kv = PagedKV(pages, layout, "vllm")
    ids = kv.table([[0, 1], [2, 3]], unique=True)
    assert kv.checked(ids) is ids
    for bad in ([[0, 1]], ids.to(torch.int32), ids[:, :1].contiguous(), ids.t()):
        with pytest.raises(LayoutError, match="checked=True"):
            Saver(pages, layout, "vllm").save(bad, checked=True)
    t = torch.tensor([[4, 5]])
    got = kv.table(t)
    t[0, 0] = 99                    # the caller changes its table: the checked copy does not
    assert got.tolist() == [[4, 5]]


def test_scatter_refuses_repeated_destination_pages_untouched():
    layout, pages = mha_case()
    snapshot = [as_bytes(t).clone() for t in pages]
    blocks = torch.ones(2, layout.block_bytes, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="more than once"):
        scatter(blocks, pages, [[1, 2], [3, 1]], layout, "vllm")
    assert all(torch.equal(as_bytes(t), s) for t, s in zip(pages, snapshot))


def test_errors_name_the_expected_shape_and_fix():
    layout, pages = mha_case("flashinfer")
    with pytest.raises(LayoutError, match=r"\[10, 2, 4, 2, 4\]"):
        gather([t[:, :1] for t in pages], [[0, 1]], layout, "flashinfer")
    with pytest.raises(LayoutError, match="multiple of the engine's page_tokens 3"):
        gather([torch.zeros(10, 2, 3, 2, 4, dtype=torch.float16)] * 2, [[0]], layout, "flashinfer")
    with pytest.raises(LayoutError, match="pages 0..9"):
        gather(pages, [[0, 99]], layout, "flashinfer")


def test_layout_dtype_blocks_accepted():
    layout, pages = mha_case("flashinfer")
    kv = PagedKV(pages, layout, "flashinfer")
    typed = torch.empty(1, *layout.block_shape, dtype=layout.dtype)
    kv.gather([[5, 2]], out=typed)
    assert torch.equal(typed.view(torch.uint8).reshape(1, -1), kv.gather([[5, 2]]))


# -- loader and saver (CPU: synchronous, same API) ------------------------------------
@pytest.mark.parametrize("fmt", ["vllm", "flashinfer", "mla"])
def test_layer_loader_and_saver_round_trip_on_cpu(fmt, monkeypatch):
    if fmt == "mla":
        layout = KVLayout.mla(3, 8, 4, 4, torch.bfloat16)
    else:
        layout = KVLayout.mha(3, 2, 4, 4, torch.bfloat16)
    src = random_pages(fmt, layout, 8, 2, 1)
    table = [[6, 1], [3, 0], [7, 5]]
    saved = Saver(src, layout, fmt).save(table)
    saved.wait_for_pages()
    assert saved.done()
    blocks = saved.wait()
    assert blocks.device.type == "cpu" and torch.equal(blocks, expected_blocks(fmt, layout, src, table))

    dst = random_pages(fmt, layout, 8, 2, 2)
    from kvtier.transfer import streams
    order = []
    real = streams.copy
    monkeypatch.setattr(streams, "copy", lambda views, *a, **k: (order.append(views[0].data_ptr()), real(views, *a, **k)))
    loader = LayerLoader(dst, layout, fmt)
    handle = loader.load(blocks, table)
    assert order == [loader.kv.views[l].data_ptr() for l in range(3)]   # layer 0 first, one copy each
    for i in range(layout.num_layers):
        handle.wait_for_layer(i)             # returns at once on a CPU
    with pytest.raises(LayoutError):
        handle.wait_for_layer(layout.num_layers)
    handle.wait()
    assert handle.done()
    assert torch.equal(gather(dst, table, layout, fmt), blocks)


def test_load_handle_waits_for_the_staging_thread_and_reports_its_failure():
    import threading
    import time

    from kvtier.errors import TransferError
    from kvtier.transfer import LoadHandle

    h = LoadHandle(2)
    reached: list[int] = []
    threading.Thread(target=lambda: (time.sleep(0.05), h._ready(0, True), reached.append(1),
                                     h._ready(1, True))).start()
    h.wait_for_layer(1)                       # blocks until the thread has queued layer 1
    assert reached == [1] and h.done()
    bad = LoadHandle(2)
    bad._ready(0, True)
    bad._failed(RuntimeError("pinned allocation failed"))
    bad.wait_for_layer(0)
    with pytest.raises(TransferError, match="layer 1 failed: pinned allocation failed"):
        bad.wait_for_layer(1)


def test_loader_rejects_device_blocks_and_bad_rows():
    layout, pages = mha_case()
    loader = LayerLoader(pages, layout, "vllm")
    with pytest.raises(LayoutError, match="CPU tensor"):
        loader.load(torch.empty(1, layout.block_bytes, dtype=torch.uint8, device="meta"), [[0, 1]])
    with pytest.raises(LayoutError, match="expected a contiguous"):
        loader.load(torch.empty(2, layout.block_bytes, dtype=torch.uint8), [[0, 1]])


# -- the CUDA kernel --------------------------------------------------------------------
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed: the kernel compile check needs the CUDA toolkit")
def test_kernel_compiles_for_sm90_with_16_byte_vectors(tmp_path):
    ptx = tmp_path / "paged_copy.ptx"
    r = subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-o", str(ptx), str(CSRC / "paged_copy.cu")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = ptx.read_text()
    assert "ld.global.v4.u32" in text and "st.global.v4.u32" in text     # 16-byte loads and stores
    assert "ld.global.u8" in text                                        # and the narrow fallback
    r = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-o", str(tmp_path / "paged_copy.cubin"),
                        str(CSRC / "paged_copy.cu")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_vector_width_follows_alignment():
    from kvtier.transfer.pages import vector_width
    assert vector_width(4096, 65536, 1 << 40) == 16
    assert vector_width(4096, 8) == 8
    assert vector_width(6, 4096) == 2
    assert vector_width(4096, 3) == 1


def test_layer_groups_cover_every_layer_once_in_rows_at_least_min_wide(monkeypatch):
    from kvtier.transfer import streams
    monkeypatch.setattr(streams, "MIN_DMA_ROW", 100)
    assert streams.layer_groups(7, 30) == [(0, 4), (4, 3)]           # 4 x 30 >= 100; the last may be short
    assert streams.layer_groups(3, 100) == [(0, 1), (1, 1), (2, 1)]  # a layer is wide enough alone
    assert streams.layer_groups(3, 1) == [(0, 3)]                    # never more than every layer
    monkeypatch.setattr(streams, "MIN_DMA_ROW", 256 << 10)
    for layers, lb in ((61, 18432), (32, 1 << 20), (4, 16384), (1, 7)):
        groups = streams.layer_groups(layers, lb)
        assert [l for l0, k in groups for l in range(l0, l0 + k)] == list(range(layers))
        assert all(k * lb >= 256 << 10 for _, k in groups[:-1])


def test_without_cuda_the_fallback_is_used_and_says_why():
    if CUDA:
        pytest.skip("CUDA present: the kernel path is tested by the gpu tests")
    assert kernels.status().startswith("torch fallback")
    layout, pages = mha_case()
    with pytest.raises(LayoutError, match="CUDA"):
        PagedKV(pages, layout, "vllm").gather([[0, 1]], impl="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["vllm", "flashinfer", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_kernel_matches_torch_fallback(fmt, dtype):
    assert kernels.load() is not None, kernels.status()
    layout = (KVLayout.mla(4, 512, 64, 64, dtype) if fmt == "mla" else KVLayout.mha(4, 8, 128, 32, dtype))
    page_tokens = 16
    pages = random_pages(fmt, layout, 64, page_tokens, 0, "cuda")
    ppb = layout.block_tokens // page_tokens
    table = torch.randint(0, 64, (20, ppb))                   # repeats allowed for gather
    kv = PagedKV(pages, layout, fmt)
    a, b = kv.gather(table, impl="cuda"), kv.gather(table, impl="torch")
    assert torch.equal(a, b) and torch.equal(a.cpu(), expected_blocks(fmt, layout, [p.cpu() for p in pages], table.tolist()))
    unique = torch.randperm(64)[: 10 * ppb].reshape(10, ppb)
    blocks = torch.randint(0, 256, (10, layout.block_bytes), dtype=torch.uint8, device="cuda")
    d1 = random_pages(fmt, layout, 64, page_tokens, 1, "cuda")
    d2 = [t.clone() for t in d1]
    PagedKV(d1, layout, fmt).scatter(blocks, unique, impl="cuda")
    PagedKV(d2, layout, fmt).scatter(blocks, unique, impl="torch")
    assert all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(d1, d2))
    # an odd offset forces narrow loads: still the same bytes
    odd = torch.empty(10 * layout.block_bytes + 1, dtype=torch.uint8, device="cuda")[1:].view(10, -1)
    kv.gather(unique, out=odd, impl="cuda")
    assert torch.equal(odd, kv.gather(unique, impl="torch"))


@pytest.mark.gpu
@gpu
def test_gpu_copy_2d_moves_strided_rows_both_ways():
    from kvtier.transfer import kernels
    host = torch.randint(0, 256, (8, 512), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(5, 100, dtype=torch.uint8, device="cuda")
    assert kernels.copy_2d(dev, 100, 100, host, 512 + 37, 512, 100, 4)     # host rows 1-4, bytes 37-136
    back = torch.zeros(8, 512, dtype=torch.uint8).pin_memory()
    kernels.copy_2d(back, 2 * 512 + 10, 512, dev, 100, 100, 100, 4)        # -> back rows 2-5, bytes 10-109
    torch.cuda.synchronize()
    assert torch.equal(dev[1:].cpu(), host[1:5, 37:137]) and int(dev[0].count_nonzero()) == 0
    assert torch.equal(back[2:6, 10:110], host[1:5, 37:137])
    back[2:6, 10:110] = 0
    assert int(back.count_nonzero()) == 0                                    # nothing else written
    with pytest.raises(RuntimeError, match="outside"):
        kernels.copy_2d(dev, 0, 100, host, 0, 512, 100, 9)                   # 9 rows do not fit in dev


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["2d dma by layer", "2d dma by groups", "whole rows"])
def test_gpu_loader_paths_write_the_same_pages(path, monkeypatch):
    from kvtier.transfer import kernels, streams
    layout = KVLayout.mha(3, 2, 64, 32, torch.float16)
    pages = random_pages("vllm", layout, 64, 16, 0, "cuda")
    table = torch.randperm(64)[:20].reshape(10, 2)
    blocks = torch.randint(0, 256, (10, layout.block_bytes), dtype=torch.uint8).pin_memory()
    if path == "whole rows":                   # no extension: rows go up whole, then are scattered
        monkeypatch.setattr(kernels, "load", lambda: None)
    # groups of 1 layer, or of 2 (layers 0-1, then 2): each group one DMA and one scatter
    monkeypatch.setattr(streams, "MIN_DMA_ROW", layout.layer_bytes * (2 if path == "2d dma by groups" else 1))
    loader = LayerLoader(pages, layout, "vllm")
    handle = loader.load(blocks, table)
    for l in range(layout.num_layers):
        handle.wait_for_layer(l)
    handle.wait()
    torch.cuda.synchronize()
    assert torch.equal(gather(pages, table, layout, "vllm").cpu(), blocks)
    saved = Saver(pages, layout, "vllm").gather(table)        # and back by the same groups
    back = torch.zeros(12, layout.block_bytes, dtype=torch.uint8).pin_memory()
    saved.copy_to(back, list(range(10)), [11 - i for i in range(10)])
    assert torch.equal(back[2:].flip(0), blocks) and int(back[:2].count_nonzero()) == 0


@pytest.mark.gpu
@gpu
def test_gpu_loader_overlaps_copy_with_compute(monkeypatch):
    from kvtier.transfer import streams
    monkeypatch.setattr(streams, "MIN_DMA_ROW", 1)           # layer by layer: 8 DMAs, 8 events
    layout = KVLayout.mha(8, 8, 128, 16, torch.bfloat16)
    pages = random_pages("flashinfer", layout, 4096, 16, 0, "cuda")
    table = torch.randperm(4096)[:512].reshape(512, 1)     # 512 blocks of 512 KiB = 256 MiB
    blocks = torch.randint(0, 256, (512, layout.block_bytes), dtype=torch.uint8).pin_memory()
    loader = LayerLoader(pages, layout, "flashinfer")
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start, after0, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    handle = loader.load(blocks, table)
    handle.wait_for_layer(0)
    after0.record()
    for i in range(1, layout.num_layers):
        x = x @ x.T / 4096                      # "compute layer i-1" while later layers arrive
        handle.wait_for_layer(i)
    end.record()
    handle.wait()
    torch.cuda.synchronize()
    assert torch.equal(gather(pages, table, layout, "flashinfer").cpu(), blocks)
    # layer 0 is usable well before the whole load is: the engine did not wait for all of it
    assert start.elapsed_time(after0) < 0.5 * start.elapsed_time(end)


@pytest.mark.gpu
@gpu
def test_gpu_saver_does_not_block_the_engine_stream():
    layout = KVLayout.mla(8, 512, 64, 64, torch.bfloat16)
    pages = random_pages("mla", layout, 1024, 64, 0, "cuda")
    table = torch.arange(512).reshape(512, 1)
    saver = Saver(pages, layout, "mla")
    torch.cuda.synchronize()
    h = saver.save(table)
    h.wait_for_pages()
    assert torch.equal(h.wait(), gather(pages, table, layout, "mla").cpu())
