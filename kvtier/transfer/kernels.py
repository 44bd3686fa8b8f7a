"""The CUDA gather/scatter kernel (csrc/paged_copy.cu), compiled on first use on a GPU.

Built with torch.utils.cpp_extension.load_inline (nvcc and ninja at run time, cached by
torch under ~/.cache/torch_extensions); nothing is built at install. If the build fails,
kvtier logs why once and uses the torch fallback, which moves the same bytes.
Set KVTIER_NO_KERNELS=1 to skip the kernel altogether.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import torch

from kvtier.errors import TransferError

log = logging.getLogger("kvtier.transfer")

CSRC = Path(__file__).resolve().parents[2] / "csrc"
KERNEL_SOURCE = CSRC / "paged_copy.cu"
BINDING_SOURCE = CSRC / "paged_copy_torch.cu"

_lock = threading.Lock()
_module: object | None = None
_error: str | None = None
_ptr_cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

_DECL = ("void paged_copy(torch::Tensor layer_ptrs, torch::Tensor table, torch::Tensor blocks, int64_t layers, "
         "int64_t parts, int64_t pages_per_block, int64_t chunk_bytes, int64_t page_stride, int64_t part_stride, "
         "int64_t layer_bytes, int64_t part_bytes, bool to_blocks, int64_t vec);\n"
         "void copy_2d(torch::Tensor dst, int64_t dst_offset, int64_t dpitch, torch::Tensor src, "
         "int64_t src_offset, int64_t spitch, int64_t width, int64_t height);")


def load() -> object | None:
    """The compiled extension, or None (no CUDA, no sources, build failed, or turned off)."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("KVTIER_NO_KERNELS"):
            _error = "KVTIER_NO_KERNELS is set"
        elif not torch.cuda.is_available():
            _error = "no CUDA device"
        elif not KERNEL_SOURCE.exists():
            _error = f"{KERNEL_SOURCE} is missing (kvtier installed without csrc/)"
        else:
            try:
                from torch.utils.cpp_extension import load_inline
                _module = load_inline(
                    name="kvtier_paged_copy", cpp_sources=_DECL,
                    cuda_sources=KERNEL_SOURCE.read_text() + "\n" + BINDING_SOURCE.read_text(),
                    functions=["paged_copy", "copy_2d"], extra_cuda_cflags=["-O3"], verbose=False)
            except Exception as e:   # no nvcc, no ninja, a compiler error: fall back, say why once
                _error = f"{type(e).__name__}: {e}"
                log.warning("kvtier: CUDA paged-copy kernel unavailable, using torch ops (%s)", _error)
        return _module


def status() -> str:
    """'cuda kernel' or 'torch fallback (why)', for stats and benchmarks."""
    m = load()
    return "cuda kernel" if m is not None else f"torch fallback ({_error})"


def paged_copy(views: Sequence[torch.Tensor], ids: torch.Tensor, blocks: torch.Tensor, to_blocks: bool,
               required: bool = False) -> bool:
    """Run the kernel on the current stream; False if it is unavailable (unless required)."""
    from kvtier.transfer.pages import vector_width

    m = load()
    if m is None:
        if required:
            raise TransferError(f"the CUDA paged-copy kernel is unavailable: {_error}")
        return False
    _, parts, chunk = views[0].shape
    ppb = ids.shape[1]
    page_stride, part_stride = views[0].stride(0), views[0].stride(1) if parts > 1 else 0
    layer_bytes = parts * ppb * chunk
    ptrs = tuple(v.data_ptr() for v in views)
    vec = vector_width(chunk, page_stride, part_stride, blocks.stride(0), layer_bytes, ppb * chunk,
                       blocks.data_ptr(), *ptrs)
    m.paged_copy(_pointers(blocks.device, ptrs), ids, blocks, len(views), parts, ppb, chunk,
                 page_stride, part_stride, layer_bytes, ppb * chunk, to_blocks, vec)
    return True


def copy_2d(dst: torch.Tensor, dst_offset: int, dpitch: int, src: torch.Tensor, src_offset: int, spitch: int,
            width: int, height: int) -> bool:
    """`height` rows of `width` bytes, row r from src byte src_offset + r * spitch to dst byte
    dst_offset + r * dpitch, as one DMA queued on the current stream (contiguous uint8
    tensors, a CUDA one on at least one side). False if the extension is unavailable."""
    m = load()
    if m is None:
        return False
    m.copy_2d(dst, dst_offset, dpitch, src, src_offset, spitch, width, height)
    return True


def _pointers(device: torch.device, ptrs: tuple[int, ...]) -> torch.Tensor:
    """The layers' base addresses as a device int64 tensor (kept: engines reuse their caches)."""
    key = (str(device), ptrs)
    t = _ptr_cache.get(key)
    if t is None:
        if len(_ptr_cache) > 64:
            _ptr_cache.clear()
        t = torch.tensor(ptrs, dtype=torch.int64).to(device)
        _ptr_cache[key] = t
    return t
