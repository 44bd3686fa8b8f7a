"""Host <-> GPU movers that overlap with the engine: LayerLoader and Saver.

    handle = loader.load(host_blocks, block_table)    # returns at once on a GPU
    for i in range(num_layers):
        handle.wait_for_layer(i)                      # engine stream waits for layer i only
        ...compute layer i...

    saved = saver.save(block_table)                   # gather + copy out on a side stream
    saved.wait_for_pages()                            # before the engine overwrites those pages
    store.put(keys, saved.wait())                     # pinned host blocks

On a GPU each mover has its own CUDA stream; a load's staging thread packs layer i of
every block into pinned staging (one contiguous range per layer), copies it to the GPU,
scatters it into the engine's pages and records an event, layer after layer, so the
engine computes layer 0 while later layers are in flight (`blocks` must stay unchanged
until wait() returns). A save waits for the engine's stream (it sees every write queued
so far), gathers on its own stream and copies to pinned host memory without blocking
the engine. On a CPU the same calls copy synchronously and every wait
returns at once.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from kvtier.errors import LayoutError, TransferError
from kvtier.layout import KVLayout
from kvtier.transfer.pages import PagedKV, copy


def _host_blocks(blocks: object, n: int, layout: KVLayout, what: str) -> torch.Tensor:
    if not isinstance(blocks, torch.Tensor) or blocks.device.type != "cpu":
        raise LayoutError(f"{what} must be a CPU tensor [{n}, {layout.block_bytes}] uint8 (e.g. the `out` "
                          "of store.get(); pinned memory copies at the link's speed)")
    ok = ((blocks.dtype == torch.uint8 and tuple(blocks.shape) == (n, layout.block_bytes))
          or (blocks.dtype == layout.dtype and tuple(blocks.shape) == (n, *layout.block_shape)))
    if not ok or not blocks.is_contiguous():
        raise LayoutError(f"{what} is {list(blocks.shape)} {blocks.dtype}; expected a contiguous "
                          f"[{n}, {layout.block_bytes}] uint8 tensor (one row per block_table row)")
    return blocks.detach().view(torch.uint8).reshape(n, layout.block_bytes)


class LoadHandle:
    """A load in flight. wait_for_layer(i): the current CUDA stream waits until layer i is in place."""

    def __init__(self, num_layers: int, device: torch.device | None = None) -> None:
        self.num_layers, self.device = num_layers, device
        self._events: list = [None] * num_layers   # per layer: a CUDA event, or True once copied on a CPU
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._keep: tuple = ()                     # staging and device buffers live until the copies finish

    def _ready(self, layer: int, event: object) -> None:
        with self._cond:
            self._events[layer] = event
            self._cond.notify_all()

    def _failed(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def _event(self, layer: int) -> object:
        """Layer i's event, once the staging thread has queued its copies (host waits only for that)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer!r} out of range: this load has layers 0..{self.num_layers - 1}")
        with self._cond:
            self._cond.wait_for(lambda: self._events[layer] is not None or self._error is not None)
            if self._events[layer] is None:
                raise TransferError(f"loading layer {layer} failed: {self._error}") from self._error
            return self._events[layer]

    def wait_for_layer(self, layer: int) -> None:
        """Make the current stream wait for layer `layer` (returns at once on a CPU)."""
        ev = self._event(layer)
        if ev is not True:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def done(self) -> bool:
        with self._cond:
            return self._error is None and all(e is True or (e is not None and e.query()) for e in self._events)

    def wait(self) -> None:
        """Block the host until every layer is in place."""
        ev = self._event(self.num_layers - 1)    # one stream, in order: the last event covers all
        if ev is not True:
            ev.synchronize()
        self._keep = ()


class SaveHandle:
    """A save in flight; `blocks` is the host tensor it fills ([n, block_bytes] uint8)."""

    def __init__(self, blocks: torch.Tensor, read: object | None, copied: object | None, keep: tuple,
                 device: torch.device | None = None) -> None:
        self.blocks, self.device = blocks, device
        self._read, self._copied, self._keep = read, copied, keep

    def wait_for_pages(self) -> None:
        """The current CUDA stream waits until the pages were read: the engine may reuse them after."""
        if self._read is not None:
            torch.cuda.current_stream(self.device).wait_event(self._read)

    def done(self) -> bool:
        return self._copied is None or self._copied.query()

    def wait(self) -> torch.Tensor:
        """Block the host until the bytes are in `blocks`, and return it."""
        if self._copied is not None:
            self._copied.synchronize()
        self._keep = ()
        return self.blocks


class _Mover:
    """pages_per_layer may also be a ready PagedKV (e.g. PagedKV.of_pool: pages in kvtier's device tier)."""

    def __init__(self, pages_per_layer: Sequence[torch.Tensor] | PagedKV, layout: KVLayout,
                 page_format: str = "mla", impl: str = "auto") -> None:
        self.kv = (pages_per_layer if isinstance(pages_per_layer, PagedKV)
                   else PagedKV(pages_per_layer, layout, page_format))
        self.layout, self.impl = layout, impl
        self.cuda = self.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.kv.device) if self.cuda else None


class LayerLoader(_Mover):
    """Host blocks -> engine pages, layer by layer, on a dedicated CUDA stream (sync on a CPU).

    On a GPU a staging thread packs layer l of every block into pinned memory and queues
    its copy and scatter, so load() returns at once and the engine starts on layer 0
    while the thread packs layer 1. Loads run one after another, in call order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load") if self.cuda else None

    def load(self, blocks: torch.Tensor, block_table: object) -> LoadHandle:
        ids = self.kv.table(block_table, unique=True)
        n, L, lb = ids.shape[0], self.layout.num_layers, self.layout.layer_bytes
        src = _host_blocks(blocks, n, self.layout, "blocks")
        handle = LoadHandle(L, self.kv.device)
        if not self.cuda:
            for l in range(L):
                copy([self.kv.views[l]], ids, src[:, l * lb:(l + 1) * lb], to_blocks=False, impl=self.impl)
                handle._ready(l, True)
            return handle
        self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))   # ids and earlier engine work
        ids.record_stream(self.stream)
        staging = torch.empty(L, n, lb, dtype=torch.uint8, pin_memory=True)
        handle._keep = (src, staging, ids)
        self._thread.submit(self._stage, handle, src, staging, ids)
        return handle

    def _stage(self, handle: LoadHandle, src: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor) -> None:
        L, lb = self.layout.num_layers, self.layout.layer_bytes
        try:
            with torch.cuda.device(self.kv.device), torch.cuda.stream(self.stream):
                dev = torch.empty(staging.shape, dtype=torch.uint8, device=self.kv.device)
                handle._keep += (dev,)
                for l in range(L):
                    staging[l].copy_(src[:, l * lb:(l + 1) * lb])            # CPU: pack layer l contiguously
                    dev[l].copy_(staging[l], non_blocking=True)              # DMA while the CPU packs l+1
                    copy([self.kv.views[l]], ids, dev[l], to_blocks=False, impl=self.impl)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    handle._ready(l, ev)
        except BaseException as e:   # the engine's wait_for_layer raises it instead of hanging
            handle._failed(e)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class Saver(_Mover):
    """Engine pages -> host blocks without blocking the engine's stream (sync on a CPU)."""

    def save(self, block_table: object, out: torch.Tensor | None = None) -> SaveHandle:
        ids = self.kv.table(block_table)
        n, bb = ids.shape[0], self.layout.block_bytes
        host = (torch.empty(n, bb, dtype=torch.uint8, pin_memory=self.cuda) if out is None
                else _host_blocks(out, n, self.layout, "out"))
        if not self.cuda:
            copy(self.kv.views, ids, host, to_blocks=True, impl=self.impl)
            return SaveHandle(host if out is None else out, None, None, ())
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))   # see every write queued so far
        ids.record_stream(stream)
        read, copied = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(stream):
            dev = torch.empty(n, bb, dtype=torch.uint8, device=self.kv.device)
            copy(self.kv.views, ids, dev, to_blocks=True, impl=self.impl)
            read.record(stream)
            host.copy_(dev, non_blocking=True)
            copied.record(stream)
        return SaveHandle(host if out is None else out, read, copied, (dev, ids), self.kv.device)
