"""One big host allocation for a tier: page-aligned, prefaulted, pinned when CUDA is here.

Pinned (page-locked) memory lets a GPU copy to and from it by DMA at the link's speed.
Without CUDA, `pin_memory=True` raises, so the pool is an anonymous mmap: page-aligned
(which copies several times faster than an unaligned np.empty buffer here) but pageable,
and the tier's stats say so.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np
import torch

PAGE = mmap.PAGESIZE


@dataclass
class HostBuffer:
    """A page-aligned host allocation seen as a uint8 tensor and a numpy array (same bytes)."""

    tensor: torch.Tensor
    array: np.ndarray
    nbytes: int
    memory: str          # "pinned" or "pageable"
    note: str            # why, for stats
    _mmap: mmap.mmap | None = None

    def close(self) -> None:
        if self._mmap is not None:
            # Views still alive keep the mapping (BufferError); the GC frees it later.
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None


def _cuda_ready() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver is the same as no GPU for a host buffer
        return False


def allocate_host(nbytes: int, pin: bool | None = None) -> HostBuffer:
    """Allocate and prefault `nbytes` of host memory; pinned if `pin` (default: when CUDA is here)."""
    nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
    want_pin = _cuda_ready() if pin is None else pin
    if want_pin and _cuda_ready():
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t.zero_()   # prefault: the first touch of fresh memory is slow, pay it now
        return HostBuffer(t, t.numpy(), nbytes, "pinned", "cudaHostAlloc (page-locked)")
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)   # fewer TLB misses on big copies, where allowed
        except OSError:
            pass
    arr = np.frombuffer(m, dtype=np.uint8)
    arr.fill(0)  # prefault every page now rather than on the first put
    note = "page-aligned mmap; not pinned: " + (
        "no CUDA on this machine" if not _cuda_ready() else "pinning was turned off")
    return HostBuffer(torch.from_numpy(arr), arr, nbytes, "pageable", note, m)
