"""Device tier: the top tier, one uint8 torch allocation in GPU memory cut into slots.

`DeviceTier(capacity="20GiB", device="cuda:0")`. With device=None it uses cuda:0 when
CUDA is here and a CPU tensor otherwise, so a store, an engine and the tests run the
same code on any machine; info() (and so store.stats()) says which.

`tensor` is the whole pool as [slots, block_bytes] uint8 on the device: the transfer path
(kvtier.transfer.gather/scatter) reads and writes slots there without a host copy. The
store hands this tier host rows (numpy), so write/read below copy host <-> device; on a
CPU they are plain numpy row copies, exactly like HostTier.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.errors import ConfigError, TierSizeError
from kvtier.ids import BlockKey, SlotId
from kvtier.tiers.base import Demand, Tier, copy_runs, rows_into_slots, slots_into_rows
from kvtier.tiers.memory import cuda_ready, memory_demand, out_of_memory, prefault, too_large
from kvtier.units import format_bytes


def resolve_device(device: str | torch.device | None) -> torch.device:
    """device=None -> cuda:0 when CUDA is here, else cpu; a CUDA device without CUDA is an error."""
    if device is None:
        return torch.device("cuda:0" if cuda_ready() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be like 'cuda:0' or 'cpu', got {device!r}") from e
    if dev.type == "cuda":
        if not cuda_ready():
            raise ConfigError(f"device {device!r} asked for CUDA but torch sees no CUDA device here: "
                              "leave the device unset (CUDA when present, else the CPU) or give 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"device must be a CUDA device or 'cpu', got {device!r}")
    return dev


def _first_line(e: BaseException) -> str:
    """torch's CUDA errors span several lines: the first says what happened."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def gpu_too_large(what: str, nbytes: int, device: torch.device) -> TierSizeError | None:
    """The error for a `what` of `nbytes` that `device` cannot give now, or None (the GPU's
    counterpart of tiers.memory.too_large). What it can give: the driver's free memory plus
    what torch's caching allocator holds unused (a model's load leaves GiBs there, which
    torch.empty reuses). A GPU that cannot answer is a ConfigError."""
    try:
        free, total = torch.cuda.mem_get_info(device)
        free += max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    except (RuntimeError, AssertionError) as e:
        raise ConfigError(f"{device}: could not ask the GPU for its free memory: {_first_line(e)}") from e
    return out_of_memory(what, nbytes, (str(device), free, total)) if nbytes > free else None


class DeviceTier(Tier):
    """Blocks in GPU memory (or a CPU tensor without a GPU). `DeviceTier(capacity="20GiB")`."""

    kind = "device"

    def __init__(self, capacity: int | str | None = None, *, blocks: int | None = None,
                 name: str | None = None, device: str | torch.device | None = None) -> None:
        super().__init__(capacity, blocks=blocks, name=name)
        self.device = resolve_device(device)
        self.tensor: torch.Tensor | None = None   # [capacity_blocks, block_bytes] uint8 on self.device
        self._np: np.ndarray | None = None       # numpy view of `tensor` on a CPU
        self.prefault_s = 0.0                    # seconds spent touching the CPU pool's pages
        self._stream: torch.cuda.Stream | None = None   # copy_to's, on a GPU

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def demand(self, block_bytes: int) -> Demand:
        nbytes = self.slots_for(block_bytes) * block_bytes
        if not self.on_gpu:
            return memory_demand(nbytes, self._what())
        device = self.device
        return Demand(f"GPU memory of {device}", nbytes, lambda what, n: gpu_too_large(what, n, device), self._what())

    def _what(self) -> str:
        return f"{'GPU' if self.on_gpu else 'CPU'} memory (device tier {self.name!r})"

    def _allocate(self, slots: int, block_bytes: int) -> None:
        nbytes = slots * block_bytes
        what = self._what()
        err = gpu_too_large(what, nbytes, self.device) if self.on_gpu else too_large(what, nbytes)
        if err is not None:
            raise err
        try:
            self.tensor = torch.empty(slots, block_bytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError) as e:   # out of memory (torch's message spans lines: its first only)
            if not self.on_gpu:
                raise out_of_memory(what, nbytes) from None
            raise ConfigError(f"device tier {self.name!r}: could not allocate {format_bytes(nbytes)} "
                              f"on {self.device}: {_first_line(e)}; give it a smaller capacity") from e
        if not self.on_gpu:
            self.prefault_s = prefault(self.tensor.view(-1), what)   # now rather than on the first put
            self._np = self.tensor.numpy()

    # Copies: runs of consecutive slots matching consecutive rows are one copy (copy_runs).
    def write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
              idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> None:
        if self._np is not None:
            rows_into_slots(self._np, slots, rows, idx)
            return
        with warnings.catch_warnings():   # rows may be read-only numpy views: torch only reads them
            warnings.simplefilter("ignore", UserWarning)
            for s, i, n in copy_runs(slots, idx, isinstance(rows, np.ndarray)):
                src = rows[i:i + n] if n > 1 else rows[i][None]
                self.tensor[s:s + n].copy_(torch.from_numpy(np.ascontiguousarray(src)))

    def read(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray],
             idx: Sequence[int] | None = None, keys: Sequence[BlockKey] | None = None) -> list[int]:
        if self._np is not None:
            slots_into_rows(self._np, slots, rows, idx)
            return []
        for s, i, n in copy_runs(slots, idx, isinstance(rows, np.ndarray)):
            dst = rows[i:i + n] if n > 1 else rows[i][None]
            torch.from_numpy(dst).copy_(self.tensor[s:s + n])   # synchronous: the bytes are there on return
        return []

    def memory(self) -> torch.Tensor | None:
        return self.tensor if self.tensor is not None and not self.on_gpu else None

    def block(self, slot: SlotId) -> np.ndarray:
        """A view of the slot on a CPU; a host copy on a GPU."""
        if self._np is not None:
            return self._np[slot]
        return self.tensor[slot].cpu().numpy()

    def blocks(self, slots: Sequence[SlotId]) -> Sequence[np.ndarray]:
        """Views on a CPU; on a GPU one gather on the device and one copy into pinned host
        memory (from torch's caching allocator: nothing allocated per call after the first).

        Speed: a demotion read its batch one block() at a time, a synchronous copy each: on an
        H200, 254 blocks cost ~6 ms of a 4K-token request's time to first token."""
        if self._np is not None or not len(slots):
            return super().blocks(slots)
        idx = torch.tensor(list(slots), dtype=torch.int64).to(self.device)
        rows = self.tensor.index_select(0, idx)
        out = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        out.copy_(rows)                       # synchronous: the bytes are there on return
        return out.numpy()

    def copy_to(self, slots: Sequence[SlotId], memory: torch.Tensor, dst_slots: Sequence[SlotId]) -> bool:
        """On a GPU: one gather on the device, ordered by destination slot, then one DMA per
        run of consecutive destination slots straight into `memory` (the host tier's slots,
        pinned on a CUDA machine). On a CPU, False: blocks() views and one copy are as good.

        Speed: through blocks() a demotion copied every byte twice, by DMA into a pinned
        buffer and then by the CPU into the host tier (on an H200 a host hit's admission,
        which demotes the other prompt's blocks, was 7-12.5 ms of its time to first token)."""
        if self._np is not None or self.tensor is None or not len(slots):
            return False
        order = sorted(range(len(slots)), key=dst_slots.__getitem__)
        dst = [dst_slots[j] for j in order]
        if not self.on_gpu:
            self._gather_into(memory, [slots[j] for j in order], dst)
            return True
        # On a stream of its own, after the work queued so far on the calling thread's current
        # stream (a backup's thread: the default stream, which the reference engine computes on),
        # so a backup (kvtier.backup) runs beside the engine's later work instead of between it.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._gather_into(memory, [slots[j] for j in order], dst)
        self._stream.synchronize()            # the bytes are there on return
        return True

    def _gather_into(self, memory: torch.Tensor, slots: list[SlotId], dst: list[SlotId]) -> None:
        """One gather of `slots` on the device, then one copy per run of consecutive `dst` rows."""
        idx = torch.tensor(slots, dtype=torch.int64).to(self.device)
        rows = self.tensor.index_select(0, idx)
        for s, i, n in copy_runs(dst, None, True):
            memory[s:s + n].copy_(rows[i:i + n], non_blocking=True)

    def info(self) -> dict[str, Any]:
        if self.tensor is None:
            return {"memory": "unallocated", "device": str(self.device)}
        note = (f"GPU memory on {self.device}" if self.on_gpu else
                "CPU tensor: " + ("no CUDA on this machine" if not cuda_ready() else "device='cpu' was asked for"))
        info = {"memory": "device" if self.on_gpu else "cpu", "device": str(self.device),
                "memory_note": note, "allocated_bytes": self.tensor.numel()}
        if not self.on_gpu:
            info["prefault_s"] = round(self.prefault_s, 3)
        return info

    def close(self) -> None:
        self.tensor = None
        self._np = None
