"""Engine KV pages <-> kvtier blocks: page formats, validation, gather and scatter.

An engine keeps one tensor per layer, cut into pages of `page_tokens` tokens. A kvtier
block is `block_tokens` tokens (a whole number of pages), layer-major (kvtier/layout.py).
Accepted per-layer tensors (contiguous, the layout's dtype, all on one device):

    "vllm"        MHA  [2, num_pages, page_tokens, num_kv_heads, head_dim]   (K pages, then V pages)
    "flashinfer"  MHA  [num_pages, 2, page_tokens, num_kv_heads, head_dim]   (K and V inside each page)
    "mla"         MLA  [num_pages, page_tokens, kv_lora_rank + rope_dim]

`block_table[b]` lists the engine page ids that make block b, in token order:
an int tensor [n_blocks, block_tokens // page_tokens]. Everything is checked before a
byte moves: a bad call raises LayoutError and leaves every tensor as it was.

gather may read a page several times (repeats are fine). scatter refuses a table that
writes one page twice (LayoutError): there is no defined winner, so it is an error.
Pages no block names are never touched.

Both run as one CUDA launch per call on a GPU when the kernel in csrc/ compiles, else
as torch indexing ops that produce the same bytes (and are what runs on a CPU).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from kvtier.errors import LayoutError
from kvtier.layout import KVLayout, dtype_name

PAGE_FORMATS = ("vllm", "flashinfer", "mla")


def _page_shape(fmt: str, layout: KVLayout, num_pages: str, page_tokens: str) -> str:
    if fmt == "vllm":
        return f"[2, {num_pages}, {page_tokens}, {layout.num_kv_heads}, {layout.head_dim}]"
    if fmt == "flashinfer":
        return f"[{num_pages}, 2, {page_tokens}, {layout.num_kv_heads}, {layout.head_dim}]"
    return f"[{num_pages}, {page_tokens}, {layout.kv_lora_rank + layout.rope_dim}]"


def _check_layout(layout: object) -> None:
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"layout must be a kvtier.KVLayout (KVLayout.mha(...) or .mla(...)), not "
                          f"{type(layout).__name__}")


class PagedKV:
    """An engine's paged KV cache (one tensor per layer), checked once against a layout.

        kv = PagedKV(pages_per_layer, layout, "vllm")
        blocks = kv.gather(block_table)          # [n_blocks, layout.block_bytes] uint8
        kv.scatter(blocks, block_table)          # the reverse, in place
    """

    def __init__(self, pages_per_layer: Sequence[torch.Tensor], layout: KVLayout, page_format: str) -> None:
        _check_layout(layout)
        if page_format not in PAGE_FORMATS:
            raise LayoutError(f"unknown page_format {page_format!r}; choose one of {', '.join(PAGE_FORMATS)}")
        want = "mla" if page_format == "mla" else "mha"
        if layout.kind != want:
            raise LayoutError(f"page_format {page_format!r} holds {want.upper()} pages but the layout is "
                              f"{layout.kind.upper()}: use " + ("'mla'" if layout.kind == "mla" else "'vllm' or 'flashinfer'"))
        if isinstance(pages_per_layer, torch.Tensor) or not isinstance(pages_per_layer, (list, tuple)):
            raise LayoutError("pages_per_layer must be a list of one tensor per layer, shaped "
                              + _page_shape(page_format, layout, "num_pages", "page_tokens"))
        if len(pages_per_layer) != layout.num_layers:
            raise LayoutError(f"pages_per_layer has {len(pages_per_layer)} tensors; the layout has "
                              f"{layout.num_layers} layers: pass one tensor per layer")
        self.layout, self.format = layout, page_format
        first = pages_per_layer[0]
        if not isinstance(first, torch.Tensor) or first.dim() < 3:
            raise LayoutError("pages_per_layer[0] must be a tensor shaped "
                              + _page_shape(page_format, layout, "num_pages", "page_tokens"))
        self.num_pages = first.shape[1] if page_format == "vllm" else first.shape[0]
        self.page_tokens = first.shape[1] if page_format == "mla" else first.shape[2]
        expected = _page_shape(page_format, layout, str(self.num_pages), str(self.page_tokens))
        for i, t in enumerate(pages_per_layer):
            what = f"pages_per_layer[{i}]"
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{what} is a {type(t).__name__}; expected a tensor {expected}")
            if _shape_str(t) != expected:
                raise LayoutError(f"{what} has shape {_shape_str(t)}; page_format {page_format!r} with this "
                                  f"layout ({layout.describe()}) needs {expected} (the same for every layer)")
            if t.dtype != layout.dtype:
                raise LayoutError(f"{what} has dtype {t.dtype} but the layout's is {dtype_name(layout.dtype)}: "
                                  "build the KVLayout with the engine's KV dtype")
            if t.device != first.device:
                raise LayoutError(f"{what} is on {t.device} but pages_per_layer[0] is on {first.device}: "
                                  "all layers must live on one device")
            if not t.is_contiguous():
                raise LayoutError(f"{what} is not contiguous: kvtier reads and writes pages in place, "
                                  "so allocate each layer's cache as one contiguous tensor")
        if self.page_tokens <= 0 or self.num_pages <= 0:
            raise LayoutError(f"pages_per_layer[0] holds no pages (shape {_shape_str(first)})")
        if layout.block_tokens % self.page_tokens:
            raise LayoutError(f"block_tokens {layout.block_tokens} is not a multiple of the engine's "
                              f"page_tokens {self.page_tokens}: a kvtier block must be whole pages; "
                              f"use block_tokens = k * {self.page_tokens}")
        self.device = first.device
        self.pages_per_block = layout.block_tokens // self.page_tokens
        self.parts = 1 if page_format == "mla" else 2
        self.chunk_bytes = layout.layer_bytes // self.parts // self.pages_per_block
        # Each layer as bytes [num_pages, parts, chunk_bytes] (a strided view for vllm).
        self.views = [_byte_view(t, page_format, self.num_pages, self.chunk_bytes) for t in pages_per_layer]
        self.tensors = list(pages_per_layer)

    @classmethod
    def of_pool(cls, pool: torch.Tensor, layout: KVLayout) -> PagedKV:
        """The pages of an engine whose KV pages are kvtier's device tier (`DeviceTier.tensor`,
        [slots, block_bytes] uint8): a page is a whole block, layer l of slot s is bytes
        [l * layer_bytes, (l + 1) * layer_bytes) of row s. Page ids are slot numbers."""
        if (not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8 or pool.dim() != 2
                or pool.shape[1] != layout.block_bytes or not pool.is_contiguous()):
            raise LayoutError(f"a pool must be a contiguous [slots, {layout.block_bytes}] uint8 tensor "
                              "(DeviceTier.tensor of a store with this layout)")
        self = cls.__new__(cls)
        self.layout, self.format = layout, "pool"
        self.num_pages, self.page_tokens = pool.shape[0], layout.block_tokens
        self.device, self.pages_per_block, self.parts = pool.device, 1, 1
        lb = layout.layer_bytes
        self.chunk_bytes = lb
        self.views = [pool[:, l * lb:(l + 1) * lb].unsqueeze(1) for l in range(layout.num_layers)]
        self.tensors = [pool]
        return self

    @classmethod
    def of_pages(cls, pages_per_layer: Sequence[torch.Tensor], layout: KVLayout, num_pages: int) -> PagedKV:
        """An engine's pages as opaque bytes (page_format "pages"): each layer a contiguous
        tensor [num_pages, ...] (one run of bytes per page) or [2, num_pages, ...] (K pages,
        then V pages: two runs). A kvtier block holds, layer after layer, its pages' bytes in
        the engine's own order; layout.layer_bytes must equal pages_per_block x page bytes.
        What the bytes mean is the engine's business: say it in layout.variant."""
        _check_layout(layout)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise LayoutError(f"num_pages must be a whole number >= 1, got {num_pages!r}")
        if (isinstance(pages_per_layer, torch.Tensor) or not isinstance(pages_per_layer, (list, tuple))
                or len(pages_per_layer) != layout.num_layers
                or not all(isinstance(t, torch.Tensor) for t in pages_per_layer)):
            raise LayoutError(f"pages_per_layer must be a list of {layout.num_layers} tensors (one per layer)")
        first = pages_per_layer[0]
        runs = 2 if first.dim() >= 2 and first.shape[0] == 2 and first.shape[1] == num_pages else 1
        if runs == 1 and (first.dim() < 1 or first.shape[0] != num_pages):
            raise LayoutError(f"pages_per_layer[0] is {_shape_str(first)}: expected [{num_pages}, ...] or [2, {num_pages}, ...]")
        page_bytes = first.numel() * first.element_size() // num_pages
        if page_bytes == 0 or layout.layer_bytes % page_bytes:
            raise LayoutError(f"a page is {page_bytes} bytes, which does not divide the layout's "
                              f"{layout.layer_bytes} bytes per layer: block_tokens must be whole pages")
        for i, t in enumerate(pages_per_layer):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or not t.is_contiguous():
                raise LayoutError(f"pages_per_layer[{i}] is {_shape_str(t)} {t.dtype} on {t.device}: every layer "
                                  f"must be contiguous, shaped and typed like layer 0 ({_shape_str(first)} {first.dtype})")
        self = cls.__new__(cls)
        self.layout, self.format = layout, "pages"
        self.num_pages, self.device, self.parts = num_pages, first.device, runs
        self.pages_per_block = layout.layer_bytes // page_bytes
        self.page_tokens = layout.block_tokens // self.pages_per_block
        self.chunk_bytes = page_bytes // runs
        self.views = [_byte_view(t, "vllm" if runs == 2 else "mla", num_pages, self.chunk_bytes)
                      for t in pages_per_layer]
        self.tensors = list(pages_per_layer)
        return self

    # -- checks --------------------------------------------------------------------
    def table(self, block_table: object, unique: bool = False, checked: bool = False) -> torch.Tensor:
        """block_table as int64 [n, pages_per_block] on the pages' device, checked; with
        checked=True, block_table is what table() returned for this cache before (checked())."""
        if checked:
            return self.checked(block_table)
        ppb = self.pages_per_block
        if isinstance(block_table, torch.Tensor):
            if block_table.dtype.is_floating_point or block_table.dtype in (torch.bool, torch.complex64, torch.complex128):
                raise LayoutError(f"block_table has dtype {block_table.dtype}; pass an integer tensor of page ids")
            t = block_table
        else:
            try:
                arr = np.asarray(block_table)
            except (ValueError, TypeError):        # ragged rows, or not numbers at all
                raise LayoutError(f"block_table must be [n_blocks, {ppb}] integer page ids (a tensor, an array "
                                  "or a list of equal rows)") from None
            if arr.size and arr.dtype.kind not in "iu":
                raise LayoutError(f"block_table must hold integer page ids, got {arr.dtype}")
            t = torch.from_numpy(arr.astype(np.int64, copy=False).reshape(arr.shape))
        if t.dim() != 2 or t.shape[1] != ppb:
            raise LayoutError(f"block_table has shape {_shape_str(t)}; expected [n_blocks, {ppb}]: each block "
                              f"of {self.layout.block_tokens} tokens is {ppb} page(s) of {self.page_tokens} tokens")
        if t.device.type != "cpu" and t.device != self.device:
            raise LayoutError(f"block_table is on {t.device} but the pages are on {self.device}: "
                              "pass it on the CPU or on the pages' device")
        host = t.detach().to("cpu", torch.int64).contiguous()
        if host.numel():
            _check_ids(host.reshape(-1).numpy(), self.num_pages, unique, ppb)
        if self.device.type == "cpu" and host.data_ptr() == t.data_ptr():
            host = host.clone()      # a loader thread reads it later: the caller may change its own
        return upload(host, self.device)

    def checked(self, ids: object) -> torch.Tensor:
        """`ids` that table() returned for this cache, handed on so they are not checked (and
        copied back from a GPU) again: only their form is checked here, not each id."""
        if (not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 2
                or ids.shape[1] != self.pages_per_block or ids.device != self.device or not ids.is_contiguous()):
            raise LayoutError("checked=True takes what this PagedKV's table() returned (int64 [n, "
                              f"{self.pages_per_block}] on {self.device}); pass the block table itself otherwise")
        return ids

    def blocks_arg(self, blocks: object, n: int, what: str) -> torch.Tensor:
        """`blocks` as uint8 [n, block_bytes] (a view, no copy), checked against this cache."""
        layout = self.layout
        shape = f"[{n}, {layout.block_bytes}] uint8 or [{n}, {', '.join(map(str, layout.block_shape))}] {dtype_name(layout.dtype)}"
        if not isinstance(blocks, torch.Tensor):
            raise LayoutError(f"{what} must be a tensor {shape}, not {type(blocks).__name__}")
        if blocks.device != self.device:
            raise LayoutError(f"{what} is on {blocks.device} but the pages are on {self.device}: gather and "
                              "scatter copy within one device (LayerLoader/Saver move between host and GPU)")
        ok = ((blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, layout.block_bytes))
              or (blocks.dtype == layout.dtype and tuple(blocks.shape) == (n, *layout.block_shape)))
        if not ok:
            raise LayoutError(f"{what} is {_shape_str(blocks)} {blocks.dtype}; expected {shape}")
        if not blocks.is_contiguous():
            raise LayoutError(f"{what} is not contiguous: pass a contiguous tensor")
        return blocks.detach().view(torch.uint8).reshape(n, layout.block_bytes)

    # -- the copies ----------------------------------------------------------------
    def gather(self, block_table: object, out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
        """Engine pages named by block_table -> [n_blocks, block_bytes] uint8 blocks (into `out` if given)."""
        ids = self.table(block_table)
        n = ids.shape[0]
        if out is None:
            out = torch.empty(n, self.layout.block_bytes, dtype=torch.uint8, device=self.device)
        blocks = self.blocks_arg(out, n, "out")
        copy(self.views, ids, blocks, to_blocks=True, impl=impl)
        return out

    def scatter(self, blocks: torch.Tensor, block_table: object, impl: str = "auto") -> None:
        """[n_blocks, block_bytes] blocks -> the engine pages named by block_table (distinct pages)."""
        ids = self.table(block_table, unique=True)
        src = self.blocks_arg(blocks, ids.shape[0], "blocks")
        copy(self.views, ids, src, to_blocks=False, impl=impl)


def copy(views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor, *, to_blocks: bool,
         impl: str = "auto", rows: torch.Tensor | None = None) -> None:
    """Move bytes between byte views [num_pages, parts, chunk] of some layers and blocks
    [n, len(views) * parts * pages_per_block * chunk] (checked by the caller).

    rows: block b is row rows[b] of `blocks` (a tier's slots, [slots, bytes]) instead of
    row b, so pages move straight to and from a tier's memory with no staging copy.
    impl: "auto" (the CUDA kernel when the tensors are on a GPU and it compiled, else
    torch ops), "torch", or "cuda" (the kernel or an error)."""
    if impl not in ("auto", "torch", "cuda"):
        raise LayoutError(f"impl must be 'auto', 'torch' or 'cuda', got {impl!r}")
    if rows is not None:
        _check_rows(rows, blocks)
        if impl == "auto" and not blocks.is_cuda and _native_copy(views, ids, blocks, to_blocks, rows):
            return
        # Elsewhere through a temporary (the kernel and the torch ops address rows 0..n-1).
        if to_blocks:
            tmp = torch.empty(ids.shape[0], blocks.shape[1], dtype=torch.uint8, device=blocks.device)
            copy(views, ids, tmp, to_blocks=True, impl=impl)
            blocks[rows.to(blocks.device)] = tmp
        else:
            copy(views, ids, blocks[rows.to(blocks.device)], to_blocks=False, impl=impl)
        return
    if impl != "torch" and blocks.is_cuda:
        from kvtier.transfer import kernels
        if kernels.paged_copy(views, ids, blocks, to_blocks, required=impl == "cuda"):
            return
    elif impl == "cuda":
        raise LayoutError("impl='cuda' needs tensors on a CUDA device")
    if impl == "auto" and not blocks.is_cuda and _native_copy(views, ids, blocks, to_blocks):
        return
    _torch_copy(views, ids, blocks, to_blocks)


# The optional C loop (kvtier/_copy.c, built by `pip install`): one memcpy per page chunk.
try:
    from kvtier._copy import check_ids as _check_ids_c, copy_chunks as _copy_chunks
except ImportError:   # no C compiler at install time: the torch ops below give the same bytes
    _copy_chunks = _check_ids_c = None


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """The whole allocation under `t` as a flat uint8 array (no copy): offsets index into it."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),)).numpy()


class ChunkPlan:
    """Where every (block, K/V part, page) chunk of a copy lies on both sides, for every
    layer: computed once with a few vectorised ops, then each layer moves in one C call.

    Speed: a load scatters layer by layer (the engine starts on layer 0 while later layers
    land); computing the offsets per layer cost ~0.5 ms a layer in tensor ops, 10-15 % of
    a 256-token load here. Now a layer costs one numpy add and the C loop."""

    def __init__(self, views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        n, ppb = ids.shape
        _, parts, chunk = views[0].shape
        self.chunk, self.layers = chunk, len(views)
        self.empty = n == 0
        part = np.arange(parts, dtype=np.int64)[None, :, None]
        # The block side: block b's layer l lies at row(b) * row_stride + l * layer_bytes, then
        # its chunks in (part, page) order (kvtier/layout.py's layer-major block).
        self.layer_bytes = parts * ppb * chunk
        row = np.arange(n, dtype=np.int64) if rows is None else rows.to("cpu", torch.int64).numpy()
        self.block_side = ((row * blocks.stride(0))[:, None, None]
                           + (part * ppb + np.arange(ppb, dtype=np.int64)[None, None, :]) * chunk
                           + blocks.storage_offset()).reshape(-1)
        self.blocks_mem = _storage_bytes(blocks)
        pages = ids.to("cpu", torch.int64).numpy()[:, None, :]
        # Every layer of an engine has the same shape, so one base serves all (plus each
        # layer's own storage offset); a pool's layers share one storage.
        base: dict[tuple[int, int], np.ndarray] = {}
        mems: dict[int, np.ndarray] = {}
        self.page_side: list[np.ndarray] = []
        self.page_mem: list[np.ndarray] = []
        for v in views:
            strides = (v.stride(0), v.stride(1))
            if strides not in base:
                base[strides] = (pages * strides[0] + part * strides[1]).reshape(-1)
            self.page_side.append(base[strides] + v.storage_offset())
            key = v.untyped_storage().data_ptr()
            if key not in mems:
                mems[key] = _storage_bytes(v)
            self.page_mem.append(mems[key])

    def layer(self, l: int, to_blocks: bool) -> None:
        """Move layer l's chunks (pages -> blocks if to_blocks, else blocks -> pages)."""
        if self.empty:
            return
        block_l = self.block_side + l * self.layer_bytes
        if to_blocks:
            _copy_chunks(self.blocks_mem, block_l, self.page_mem[l], self.page_side[l], self.chunk)
        else:
            _copy_chunks(self.page_mem[l], self.page_side[l], self.blocks_mem, block_l, self.chunk)


def native_plan(views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor,
                rows: torch.Tensor | None = None) -> ChunkPlan | None:
    """A ChunkPlan for host pages <-> host blocks (rows as in copy(), checked), or None where
    the C module is missing or a tensor is on a GPU (then use copy())."""
    if _copy_chunks is None or blocks.is_cuda or views[0].is_cuda:
        return None
    if rows is not None:
        _check_rows(rows, blocks)
    return ChunkPlan(views, ids, blocks, rows)


def _check_ids(flat: np.ndarray, num_pages: int, unique: bool, ppb: int) -> None:
    """LayoutError naming the first page id out of range or, with unique, written twice."""
    assert flat.dtype == np.int64, flat.dtype      # the C check reads the buffer as int64
    if _check_ids_c is not None:     # in C (kvtier/_copy.c): two passes, no per-call arrays
        i, kind = _check_ids_c(flat, num_pages, unique)
        if kind == 0:
            return
        page = int(flat[i])
    else:
        kind, page = 0, -1
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_pages:
            kind, page = 1, (lo if lo < 0 else hi)
        elif unique:
            counts = np.bincount(flat, minlength=hi + 1)
            if int(counts.max()) > 1:
                kind, page = 2, int(np.argmax(counts > 1))
        if kind == 0:
            return
    if kind == 1:
        raise LayoutError(f"block_table names page {page} but the engine has pages 0..{num_pages - 1}")
    rows = sorted({int(i) // ppb for i in np.flatnonzero(flat == page)})
    raise LayoutError(f"block_table writes page {page} more than once (blocks {rows}); scatter "
                      "needs distinct destination pages: give each block its own pages")


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, queued on the current stream without blocking the host.

    A copy from pageable memory may make the host wait for the stream (CUDA calls such a copy
    "possibly synchronous"): an engine's stream is usually busy. This goes through torch's
    caching pinned allocator (a block is reused only once its copy is done), so after the
    first call nothing is allocated and the copy is async. On an idle H200 both cost about
    the same for a 32K-id table (26 vs 20 us, docs/gpu.md)."""
    if device.type != "cuda":
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def _check_rows(rows: torch.Tensor, blocks: torch.Tensor) -> None:
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= blocks.shape[0]):
        raise LayoutError(f"rows name a row outside the {blocks.shape[0]} rows of blocks")


def _native_copy(views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor, to_blocks: bool,
                 rows: torch.Tensor | None = None) -> bool:
    """Pages <-> blocks on the host with exactly one copy of each byte. False where the C
    module is missing."""
    if _copy_chunks is None:
        return False
    plan = ChunkPlan(views, ids, blocks, rows)
    for l in range(plan.layers):
        plan.layer(l, to_blocks)
    return True


def _torch_copy(views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor, to_blocks: bool) -> None:
    """The fallback: one index_select (gather) or index_put (scatter) per layer."""
    n, ppb = ids.shape
    if n == 0:
        return
    views, blocks = _widen(views, blocks)
    _, parts, chunk = views[0].shape
    flat = ids.reshape(-1)
    # blocks as [n, layers, parts, pages_per_block, chunk]: block b, layer l, K/V h, page j.
    bv = blocks.view(n, len(views), parts, ppb, chunk)
    with torch.no_grad():
        for l, v in enumerate(views):
            if to_blocks:
                sel = v.index_select(0, flat).view(n, ppb, parts, chunk)
                bv[:, l].copy_(sel.transpose(1, 2))
            else:
                v[flat] = bv[:, l].transpose(1, 2).reshape(n * ppb, parts, chunk)


def _widen(views: Sequence[torch.Tensor], blocks: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same bytes seen as 8-, 4- or 2-byte words where sizes and offsets allow: torch
    indexing moves elements one by one, so wider elements are several times faster."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if views[0].shape[-1] % dt.itemsize == 0:
            try:
                return [v.view(dt) for v in views], blocks.view(dt)
            except RuntimeError:    # an offset or stride not a multiple of the word
                continue
    return list(views), blocks


def _byte_view(t: torch.Tensor, fmt: str, num_pages: int, chunk: int) -> torch.Tensor:
    b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    if fmt == "vllm":
        return b.reshape(2, num_pages, chunk).transpose(0, 1)    # [P, 2, chunk], strided
    if fmt == "flashinfer":
        return b.reshape(num_pages, 2, chunk)
    return b.reshape(num_pages, 1, chunk)


def _shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(d) for d in t.shape) + "]"


def gather(pages_per_layer: Sequence[torch.Tensor], block_table: object, layout: KVLayout, page_format: str,
           out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Engine pages of all layers -> contiguous layer-major kvtier blocks [n_blocks, block_bytes] uint8."""
    return PagedKV(pages_per_layer, layout, page_format).gather(block_table, out, impl)


def scatter(blocks: torch.Tensor, pages_per_layer: Sequence[torch.Tensor], block_table: object,
            layout: KVLayout, page_format: str, impl: str = "auto") -> None:
    """kvtier blocks -> the engine pages named by block_table (every destination page distinct)."""
    PagedKV(pages_per_layer, layout, page_format).scatter(blocks, block_table, impl)


def vector_width(*values: int) -> int:
    """The widest of 16/8/4/2/1 bytes that divides every pointer, stride and size given."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    for w in (16, 8, 4, 2):
        if g % w == 0:
            return w
    return 1
