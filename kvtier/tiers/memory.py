"""One big host allocation for a tier: page-aligned, prefaulted, pinned when CUDA is here.

Pinned (page-locked) memory lets a GPU copy to and from it by DMA at the link's speed.
Without CUDA, `pin_memory=True` raises, so the pool is an anonymous mmap: page-aligned
(which copies several times faster than an unaligned np.empty buffer here) but pageable,
and the tier's stats say so.

A tier larger than the memory the machine has free is refused before anything is mapped:
prefaulting it would push the machine into swap or the OOM killer. Prefaulting (the
first touch of every page) takes about a second per few GiB; a large one is logged and
shown as a progress bar on a terminal, and its time is kept for the tier's stats.
"""
from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import TierSizeError
from kvtier.progress import progress
from kvtier.tiers.base import Demand
from kvtier.units import format_bytes

PAGE = mmap.PAGESIZE
SHOW_PREFAULT = 1 << 30      # a tier this large says that it is prefaulting, and how far it got
PREFAULT_CHUNK = 256 << 20   # bytes touched between progress updates (large: no slower than one fill)

log = logging.getLogger("kvtier.tiers")


@dataclass
class HostBuffer:
    """A page-aligned host allocation seen as a uint8 tensor and a numpy array (same bytes)."""

    tensor: torch.Tensor
    array: np.ndarray
    nbytes: int
    memory: str          # "pinned" or "pageable"
    note: str            # why, for stats
    _mmap: mmap.mmap | None = None
    prefault_s: float = 0.0   # seconds spent touching every page at allocation

    def close(self) -> None:
        if self._mmap is not None:
            # Views still alive keep the mapping (BufferError); the GC frees it later.
            try:
                self._mmap.close()
            except BufferError:
                pass
            self._mmap = None


def cuda_ready() -> bool:
    """Whether CUDA can be used here (pinning a host tier, a device tier on the GPU)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver is the same as no GPU
        return False


def memory_available() -> tuple[int | None, int | None]:
    """(available, total) bytes of memory for new allocations on this machine: MemAvailable
    and MemTotal from /proc/meminfo (sysconf elsewhere), within a cgroup v2 memory limit
    when one is set; None where unknown."""
    avail = total = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith("kB\n")}
        avail, total = info.get("MemAvailable"), info.get("MemTotal")
    except (OSError, ValueError, IndexError):
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            avail, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (OSError, ValueError, AttributeError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read())
            total = min(total, int(limit)) if total is not None else int(limit)
            avail = min(avail, room) if avail is not None else room
    except (OSError, ValueError):
        pass
    return avail, total


def memory_demand(nbytes: int, what: str) -> Demand:
    """What a tier of `nbytes` in host RAM takes: host tiers and CPU device tiers share it."""
    return Demand("CPU memory", max(PAGE, -(-nbytes // PAGE) * PAGE), too_large, what)


def too_large(what: str, nbytes: int) -> TierSizeError | None:
    """The error for a `what` of `nbytes` that this machine's free memory cannot hold, or None."""
    avail, total = memory_available()
    if avail is None or nbytes <= avail:
        return None
    return out_of_memory(what, nbytes)


def address_space() -> tuple[int, int] | None:
    """(limit, used) bytes of this process's address space where a limit (RLIMIT_AS, `ulimit -v`)
    is set; None without one, or where unknown."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * PAGE
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return limit, used


def out_of_memory(what: str, nbytes: int, gpu: tuple[str, int, int] | None = None) -> TierSizeError:
    """A usage error: the capacity asked for does not fit in this machine's memory, or in the
    GPU's where `gpu` is (device name, free bytes, total bytes), or in the process's address-space
    limit (`ulimit -v`) where that is what refused it."""
    space = address_space() if gpu is None else None
    if space is not None and nbytes + space[1] > space[0]:
        limit, used = space
        return TierSizeError(f"{what}: {format_bytes(nbytes)} asked for, but this process's address-space limit "
                             f"(RLIMIT_AS, `ulimit -v`) is {format_bytes(limit)} and it already maps "
                             f"{format_bytes(used)}. Raise the limit (`ulimit -v unlimited`) or give the tier a "
                             "smaller capacity")
    avail, total = memory_available() if gpu is None else gpu[1:]
    where = "this machine" if gpu is None else gpu[0]
    have = (f"{where} has {format_bytes(avail)} of memory available"
            + (f" ({format_bytes(total)} in all)" if total is not None else "")) if avail is not None else \
        "the machine could not provide it"
    return TierSizeError(f"{what}: {format_bytes(nbytes)} asked for, but {have}. Give the tier a smaller "
                       "capacity: at most the available memory, less what the rest of the process needs")


def prefault(flat: np.ndarray | torch.Tensor, what: str) -> float:
    """Touch every page of `flat` (1-D uint8) now rather than on the first put; returns the
    seconds it took. Large buffers log it and advance a progress bar chunk by chunk."""
    n = flat.shape[0]
    t0 = time.perf_counter()
    if n < SHOW_PREFAULT:
        _zero(flat)
        return time.perf_counter() - t0
    log.info("prefaulting %s of %s", format_bytes(n), what)
    with progress(f"prefaulting {format_bytes(n)} of {what}", n) as bar:
        for i in range(0, n, PREFAULT_CHUNK):
            chunk = flat[i:i + PREFAULT_CHUNK]
            _zero(chunk)
            bar.advance(chunk.shape[0])
    took = time.perf_counter() - t0
    log.info("prefaulted %s of %s in %.1f s", format_bytes(n), what, took)
    return took


def _zero(x: np.ndarray | torch.Tensor) -> None:
    if isinstance(x, np.ndarray):
        x.fill(0)
    else:
        x.zero_()


def allocate_host(nbytes: int, pin: bool | None = None, what: str = "host memory") -> HostBuffer:
    """Allocate and prefault `nbytes` of host memory; pinned if `pin` (default: when CUDA is here).

    Raises TierSizeError (give a smaller capacity) when the machine cannot hold it."""
    nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
    err = too_large(what, nbytes)
    if err is not None:
        raise err
    want_pin = cuda_ready() if pin is None else pin
    if want_pin and cuda_ready():
        try:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except (RuntimeError, MemoryError):   # cudaHostAlloc refused: not enough lockable memory
            raise out_of_memory(f"{what} (pinned)", nbytes) from None
        took = prefault(t, what)   # the first touch of fresh memory is slow: pay it now
        return HostBuffer(t, t.numpy(), nbytes, "pinned", "cudaHostAlloc (page-locked)", prefault_s=took)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, MemoryError, OverflowError):   # ENOMEM: more than the kernel will map
        raise out_of_memory(what, nbytes) from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)   # fewer TLB misses on big copies, where allowed
        except OSError:
            pass
    arr = np.frombuffer(m, dtype=np.uint8)
    took = prefault(arr, what)
    note = "page-aligned mmap; not pinned: " + (
        "no CUDA on this machine" if not cuda_ready() else "pinning was turned off")
    return HostBuffer(torch.from_numpy(arr), arr, nbytes, "pageable", note, m, took)
