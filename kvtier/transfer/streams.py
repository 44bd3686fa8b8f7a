"""Host <-> GPU copiers that overlap with the engine: LayerLoader and Saver.

    handle = loader.load(host_blocks, block_table)    # returns at once on a GPU
    for i in range(num_layers):
        handle.wait_for_layer(i)                      # engine stream waits for layer i only
        ...compute layer i...

    saved = saver.save(block_table)                   # gather + copy out on a side stream
    saved.wait_for_pages()                            # before the engine overwrites those pages
    store.put(keys, saved.wait())                     # pinned host blocks

On a GPU each copier has its own CUDA stream; a load's thread queues, group of layers after
group (consecutive layers whose bytes in a block make rows of at least MIN_DMA_ROW), one
2D DMA of that group of every block (a strided range of the host rows, on a copy stream
of its own), the scatter of those bytes into the engine's pages and an event, so the
engine computes layer 0 while later layers are in flight and the link never waits for a
scatter (`blocks` must stay unchanged until wait() returns). Without the CUDA extension,
or for rows too fragmented, whole rows go up first and are scattered after. A save waits for the
engine's stream (it sees every write queued so far), gathers on its own stream and copies
to pinned host memory without blocking the engine. On a CPU a save copies synchronously; a load does too (every wait returns at
once) unless the loader is `threaded`: then a thread copies layer after layer and flags
each, exactly as the GPU staging thread does, and wait_for_layer(i) waits for layer i only.

`load` takes host rows ([n, block_bytes]); `load_held` loads straight from where a store
holds the blocks (a Store.reading(), entered on the loader's thread before layer 0), with no
copy in between. A held read may yield fewer rows than the table has (blocks evicted or
unreadable below): only those rows' pages are written (`handle.wait_rows()` says how many).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch

from kvtier.errors import LayoutError, TransferError
from kvtier.layout import KVLayout
from kvtier.transfer import kernels
from kvtier.transfer.pages import PagedKV, copy, native_plan
from kvtier.transfer.runs import copy_rows, runs

# A GPU load or save moves each group of layers with one 2D DMA per run of consecutive rows;
# past this many DMAs (fragmented slots) it moves whole rows per run instead, in one go.
MAX_LAYER_COPIES = 512
# Speed: a 2D DMA of narrow rows crosses the link slower than a flat copy (on an H100, rows
# of 16 KiB, one layer of a 64 KiB block, went at ~0.6 of a pinned copy; 256 KiB rows at
# ~0.95). Consecutive layers of a layer-major block are consecutive bytes, so layers move
# in groups whose rows are at least this wide; the engine waits for a group, not the whole.
MIN_DMA_ROW = 256 << 10

if TYPE_CHECKING:
    from kvtier.inplace import HeldBlocks

Runs = list[tuple[int, int, int]]       # (first source row, first destination row, rows): runs.runs()


def layer_groups(layers: int, layer_bytes: int) -> list[tuple[int, int]]:
    """(first layer, count) of each group of consecutive layers that crosses the link as one
    2D DMA per run: rows of at least MIN_DMA_ROW bytes, or every layer at once."""
    k = max(1, min(layers, -(-MIN_DMA_ROW // max(1, layer_bytes))))
    return [(l, min(k, layers - l)) for l in range(0, layers, k)]


def _by_layer(tensors: Sequence[torch.Tensor], groups: int, copies: int) -> bool:
    """Whether a transfer can go group by group by 2D DMA: the extension is built, the host
    tensors are contiguous, and `copies` runs x `groups` stay within MAX_LAYER_COPIES."""
    return (kernels.load() is not None and all(t.is_contiguous() for t in tensors)
            and groups * copies <= MAX_LAYER_COPIES)


def _copy_layer(dst: torch.Tensor, dst_base: int, dst_pitch: int, src: torch.Tensor, src_base: int,
                src_pitch: int, width: int, todo: Runs) -> None:
    """One group of layers' bytes (`width` of each row, at the bases) for every run, one 2D
    DMA per run, queued on the current stream."""
    for s, d, k in todo:
        kernels.copy_2d(dst, dst_base + d * dst_pitch, dst_pitch, src, src_base + s * src_pitch, src_pitch, width, k)


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
    """A load in flight. wait_for_layer(i): layer i is in place (a GPU: the current stream waits for it)."""

    def __init__(self, num_layers: int, device: torch.device | None = None, rows: int | None = None) -> None:
        self.num_layers, self.device = num_layers, device
        self.rows = rows                           # blocks written; None until a deferred read returned
        self._events: list = [None] * num_layers   # per layer: a CUDA event, or True once copied on a CPU
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._keep: tuple = ()                     # staging and device buffers live until the copies finish

    def _set_rows(self, rows: int) -> None:
        with self._cond:
            self.rows = rows
            self._cond.notify_all()

    def _ready(self, layer: int, event: object) -> None:
        with self._cond:
            self._events[layer] = event
            self._cond.notify_all()

    def _ready_group(self, first: int, count: int, stream: object) -> None:
        """Layers first..first+count-1 are queued on `stream`: one event for all of them."""
        ev = torch.cuda.Event()
        ev.record(stream)
        for layer in range(first, first + count):
            self._ready(layer, ev)

    def _failed(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """Why the load failed (layers not flagged by then are never written), or None."""
        return self._error

    def wait_rows(self) -> int:
        """How many blocks this load writes, once its blocks were read (TransferError if the read failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self.rows is not None or self._error is not None)
            if self.rows is None:
                raise TransferError(f"reading the blocks to load failed: {self._error}") from self._error
            return self.rows

    def _event(self, layer: int) -> object:
        """Layer i's event, once the loader's thread has queued (GPU) or done (CPU) its copies."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer!r} out of range: this load has layers 0..{self.num_layers - 1}")
        with self._cond:
            self._cond.wait_for(lambda: self._events[layer] is not None or self._error is not None)
            if self._events[layer] is None:
                raise TransferError(f"loading layer {layer} failed: {self._error}") from self._error
            return self._events[layer]

    def wait_for_layer(self, layer: int) -> None:
        """Wait until layer `layer` is in place (a GPU: make the current stream wait for it)."""
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
                 device: torch.device | None = None, groups: Sequence[tuple[int, int, object]] = (),
                 copy_stream: object | None = None, layer_bytes: int = 0) -> None:
        self.blocks, self.device = blocks, device
        self._read, self._copied, self._keep = read, copied, keep
        # A gather's (first layer, count, event) per group of layers (layer_groups).
        self._groups, self._stream, self._lb = list(groups), copy_stream, layer_bytes

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

    def copy_to(self, dst: torch.Tensor, src_rows: Sequence[int], dst_rows: Sequence[int], wait: bool = True) -> None:
        """Gathered device rows src_rows -> rows dst_rows of dst (host [rows, block_bytes], e.g.
        a pinned tier's slots); returns when the bytes are in, or with wait=False once they are
        queued (then wait_copies() before reading dst). Each group of layers crosses the link
        as soon as its gather is done (one 2D DMA per group and run, on the saver's copy
        stream); without the extension, or for fragmented rows, one copy per run after the gather."""
        todo = runs(src_rows, dst_rows)
        if self._stream is None or not _by_layer([dst], len(self._groups), len(todo)):
            copy_rows(self.wait(), src_rows, dst, dst_rows)
            return
        src, bb, lb = self.blocks, self.blocks.shape[1], self._lb
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            for l0, k, gathered in self._groups:
                self._stream.wait_event(gathered)
                _copy_layer(dst, l0 * lb, bb, src, l0 * lb, bb, k * lb, todo)
        if wait:
            self.wait_copies()

    def wait_copies(self) -> None:
        """Block the host until every copy_to queued so far has landed."""
        if self._stream is not None:
            self._stream.synchronize()
        self._keep = ()


class _LayerCopier:
    """pages_per_layer may also be a ready PagedKV (e.g. PagedKV.of_pool: pages in kvtier's device tier)."""

    def __init__(self, pages_per_layer: Sequence[torch.Tensor] | PagedKV, layout: KVLayout,
                 page_format: str = "mla", impl: str = "auto") -> None:
        self.kv = (pages_per_layer if isinstance(pages_per_layer, PagedKV)
                   else PagedKV(pages_per_layer, layout, page_format))
        self.layout, self.impl = layout, impl
        self.cuda = self.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.kv.device) if self.cuda else None
        # Speed: DMAs run on a stream of their own, so one layer crosses the link while the
        # next is scattered (a load) or gathered (a save).
        self.copy_stream = torch.cuda.Stream(self.kv.device) if self.cuda else None



class LayerLoader(_LayerCopier):
    """Host blocks -> engine pages, layer by layer, off the caller's thread.

    On a GPU a thread queues each layer's DMA and scatter (see the module's docstring), so
    load() returns at once and the engine starts on layer 0 while later layers arrive. On a
    CPU, `threaded=True` runs the same loop on the thread with plain copies, flagging each
    layer as it lands; without it load() copies every layer before it returns. Loads run one after another, in call order."""

    def __init__(self, *args: Any, threaded: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threaded = self.cuda or threaded
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-load") if self.threaded else None

    def load(self, blocks: torch.Tensor, block_table: object) -> LoadHandle:
        """Write `blocks` ([n, block_bytes] host rows) into the pages of block_table's n rows."""
        ids = self.kv.table(block_table, unique=True)
        n = ids.shape[0]
        src = _host_blocks(blocks, n, self.layout, "blocks")
        handle = LoadHandle(self.layout.num_layers, self.kv.device, n)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))   # ids and earlier engine work
            ids.record_stream(self.stream)
        if self._thread is None:               # a CPU, synchronous: errors reach the caller
            self._load(handle, src, ids)
            return handle
        handle._keep = (src, ids)
        self._thread.submit(self._run, handle, src, ids)
        return handle

    def _run(self, handle: LoadHandle, src: torch.Tensor, ids: torch.Tensor) -> None:
        try:
            self._load(handle, src, ids)
        except BaseException as e:   # the engine's wait_for_layer raises it instead of hanging
            handle._failed(e)

    def _load(self, handle: LoadHandle, src: torch.Tensor, ids: torch.Tensor) -> None:
        L, lb = self.layout.num_layers, self.layout.layer_bytes
        if src.shape[0] == 0:
            for l in range(L):
                handle._ready(l, True)
            return
        if not self.cuda:
            for l in range(L):
                copy([self.kv.views[l]], ids, src[:, l * lb:(l + 1) * lb], to_blocks=False, impl=self.impl)
                handle._ready(l, True)
            return
        sources = [(src, [(0, 0, src.shape[0])])]
        if not self._layerwise(handle, ids, sources):
            self._rows_then_scatter(handle, ids, sources)

    def load_held(self, hold: Callable[[], ContextManager[HeldBlocks]], block_table: object,
                  checked: bool = False, rows: int | None = None) -> LoadHandle:
        """Write blocks straight from where a store holds them into the pages of block_table's
        rows, layer by layer: `hold()` (called on the loader's thread, a Store.reading()) holds
        the leading cached blocks while every layer is copied. Host pages: one copy. Pages on
        a GPU: the held rows go up by DMA straight from the (pinned) slots or read buffer, one
        copy per run of consecutive rows, then are scattered into the pages layer by layer.
        checked=True: block_table is this cache's own table(unique=True), not checked again.
        rows: how many blocks hold() will hold, where the caller knows (blocks in memory tiers:
        all of them), so wait_rows() need not wait for the loader's thread; fewer is a failure."""
        ids = self.kv.table(block_table, unique=True, checked=checked)
        handle = LoadHandle(self.layout.num_layers, self.kv.device, rows)
        handle._keep = (ids,)
        if self.cuda:      # the ids' copy to the device and every engine op on the pages come first
            self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        if self._thread is None:
            self._load_held(handle, hold, ids)
        else:
            self._thread.submit(self._run_held, handle, hold, ids)
        return handle

    def _run_held(self, handle: LoadHandle, hold: Callable[[], ContextManager[HeldBlocks]], ids: torch.Tensor) -> None:
        try:
            self._load_held(handle, hold, ids)
        except BaseException as e:   # the engine's wait_for_layer raises it instead of hanging
            handle._failed(e)

    def _load_held(self, handle: LoadHandle, hold: Callable[[], ContextManager[HeldBlocks]], ids: torch.Tensor) -> None:
        lb = self.layout.layer_bytes
        with hold() as held:
            n = min(held.blocks, ids.shape[0])
            if handle.rows is not None and n < handle.rows:
                raise TransferError(f"{handle.rows - n} of the {handle.rows} blocks to load were not held "
                                    "(evicted before the load?)")
            handle._set_rows(n)
            if self.cuda:
                self._held_to_gpu(handle, held, ids[:n])
                return
            groups = []                  # (tier memory, its rows, the pages they go to): blocks < n only
            for g in held.groups:
                keep = [j for j, i in enumerate(g.positions) if i < n]
                if keep:
                    groups.append((g.memory, g.rows[keep], ids[[g.positions[j] for j in keep]]))
            plans = [native_plan(self.kv.views, page_ids, memory, rows) if self.impl == "auto" else None
                     for memory, rows, page_ids in groups]
            for l in range(self.layout.num_layers):
                for (memory, rows, page_ids), plan in zip(groups, plans):
                    if plan is not None:             # every chunk's offsets computed once, above
                        plan.layer(l, to_blocks=False)
                    else:
                        copy([self.kv.views[l]], page_ids, memory[:, l * lb:(l + 1) * lb], to_blocks=False,
                             impl=self.impl, rows=rows)
                handle._ready(l, True)

    def _held_to_gpu(self, handle: LoadHandle, held: HeldBlocks, ids: torch.Tensor) -> None:
        """Held host rows -> pages, layer by layer (_layerwise); where that cannot run, whole
        rows go up first (one DMA per run) and are scattered after. The device rows come from
        torch's caching allocator, so nothing is allocated per call after the first. Returns
        after the copies finished: the holds end only then."""
        n = ids.shape[0]
        sources = []
        for g in held.groups:
            keep = [(r, i) for r, i in zip(g.rows.tolist(), g.positions) if i < n]
            sources.append((g.memory, runs([r for r, _ in keep], [i for _, i in keep])))
        try:
            if not self._layerwise(handle, ids, sources):
                self._rows_then_scatter(handle, ids, sources)
        finally:                       # the held slots (and, after a failure, the pages) may be
            self.copy_stream.synchronize()   # reused once the holds end: nothing may be in flight
            self.stream.synchronize()

    def _rows_then_scatter(self, handle: LoadHandle, ids: torch.Tensor, sources: list[tuple[torch.Tensor, Runs]]) -> None:
        """Where _layerwise cannot run: whole rows go up first (one copy per run, into device rows
        from torch's caching allocator), then each group of layers is scattered and flagged."""
        n, lb = ids.shape[0], self.layout.layer_bytes
        with torch.cuda.device(self.kv.device), torch.cuda.stream(self.stream):
            dev = torch.empty(n, self.layout.block_bytes, dtype=torch.uint8, device=self.kv.device)
            handle._keep += (dev,)
            for memory, todo in sources:
                for s, d, k in todo:
                    dev[d:d + k].copy_(memory[s:s + k], non_blocking=True)
            for l0, k in layer_groups(self.layout.num_layers, lb):
                copy(self.kv.views[l0:l0 + k], ids, dev[:, l0 * lb:(l0 + k) * lb], to_blocks=False, impl=self.impl)
                handle._ready_group(l0, k, self.stream)

    def _layerwise(self, handle: LoadHandle, ids: torch.Tensor, sources: list[tuple[torch.Tensor, Runs]]) -> bool:
        """Rows -> pages on a GPU, group of layers by group (layer_groups): a group of every row
        goes up by one 2D DMA per run (sources: a [rows, block_bytes] tensor and its runs (first
        row, first block, count)) on the copy stream, is scattered into the pages in one launch
        on the loader's stream while the next group is in flight, and flags its layers. False,
        with nothing queued, where the extension is missing or the rows are too fragmented:
        the caller then moves whole rows first."""
        L, lb, bb, n = self.layout.num_layers, self.layout.layer_bytes, self.layout.block_bytes, ids.shape[0]
        groups = layer_groups(L, lb)
        if not _by_layer([m for m, _ in sources], len(groups), sum(len(r) for _, r in sources)):
            return False
        with torch.cuda.device(self.kv.device), torch.cuda.stream(self.stream):
            flat = torch.empty(n * bb, dtype=torch.uint8, device=self.kv.device)   # group g: [n, k * lb]
            flat.record_stream(self.copy_stream)
            handle._keep += (flat,)
            self.copy_stream.wait_stream(self.stream)        # after the engine's work on the pages
            for l0, k in groups:
                w = k * lb
                dev = flat[n * l0 * lb:n * (l0 + k) * lb].view(n, w)
                with torch.cuda.stream(self.copy_stream):
                    for memory, todo in sources:
                        _copy_layer(dev, 0, w, memory, l0 * lb, bb, w, todo)
                    arrived = torch.cuda.Event()
                    arrived.record(self.copy_stream)
                self.stream.wait_event(arrived)
                copy(self.kv.views[l0:l0 + k], ids, dev, to_blocks=False, impl=self.impl)
                handle._ready_group(l0, k, self.stream)
        return True

    def close(self, wait: bool = True) -> None:
        """Stop the loader's thread (loads already started still finish)."""
        if self._thread is not None:
            self._thread.shutdown(wait=wait)


class Saver(_LayerCopier):
    """Engine pages -> host blocks without blocking the engine's stream (sync on a CPU)."""

    def gather(self, block_table: object, checked: bool = False) -> SaveHandle:
        """Pages on a GPU -> device rows [n, block_bytes] on the saver's stream; the handle's
        `blocks` are those device rows (wait() before reading them). The caller copies them
        to the host itself, e.g. straight into a pinned tier's slots (kvtier.transfer.runs)."""
        if not self.cuda:
            raise LayoutError("gather() is for pages on a GPU; host pages are copied with save()")
        ids = self.kv.table(block_table, checked=checked)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))   # see every write queued so far
        ids.record_stream(stream)
        lb, groups = self.layout.layer_bytes, []
        with torch.cuda.stream(stream):
            dev = torch.empty(ids.shape[0], self.layout.block_bytes, dtype=torch.uint8, device=self.kv.device)
            for l0, k in layer_groups(self.layout.num_layers, lb):   # an event per group: copy_to starts early
                copy(self.kv.views[l0:l0 + k], ids, dev[:, l0 * lb:(l0 + k) * lb], to_blocks=True, impl=self.impl)
                ev = torch.cuda.Event()
                ev.record(stream)
                groups.append((l0, k, ev))
        dev.record_stream(self.copy_stream)
        last = groups[-1][2]
        return SaveHandle(dev, last, last, (ids,), self.kv.device, groups, self.copy_stream, lb)

    def save(self, block_table: object, out: torch.Tensor | None = None, checked: bool = False) -> SaveHandle:
        """Pages -> host blocks [n, block_bytes] (`out`, or pinned memory on a GPU); checked=True:
        block_table is this cache's own table() output, not checked again."""
        ids = self.kv.table(block_table, checked=checked)
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
