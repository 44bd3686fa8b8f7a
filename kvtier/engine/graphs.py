"""Decode steps replayed as CUDA graphs: one captured forward per (batch, pages) bucket.

On a GPU a decode step of a small model is bound by kernel launches, not by the kernels:
kimi-small's 8 layers took 10.5 ms a step at batch 1 on an H200, for a few hundred small
kernels each launched from Python. A CUDA graph records a step's kernels once and replays
them with one launch, but only with the shapes and addresses it was captured with. So a
decode step here has a static shape: the batch is padded up to a power of two (padding
rows decode token 0 at position 0 in a scratch page of their own, which nothing else
reads), and the page table up to a power of two of pages (keys past each sequence's
position are masked). A step's inputs (token ids, positions, page table: one small copy)
go into the bucket's static tensors; key rows, the mask and the rows the new KV is written
to are computed inside the graph from them (kvtier.engine.batch.decode_batch).

A bucket is captured the first time a step needs it (two warm-up runs on a side stream,
then the capture: a few forward passes, and torch's device-wide synchronize and cache
flush before a capture: that first step takes longer), and kept until the engine closes.
A capture that fails (an op that reads back to the host, an op this torch cannot capture)
turns graphs off for the engine, with one warning, and every step runs eagerly from then on.

With `capture=False` (a CPU, or tests) the same padded step runs eagerly: what a graph
would replay, checkable without a GPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from kvtier.engine.batch import decode_batch
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class DecodeStep:
    """A step in which every scheduled sequence decodes one token and samples the next."""

    token_ids: list[int]
    positions: list[int]
    pages: list[list[int]]       # each sequence's pages up to the one holding its position


@dataclass
class _Bucket:
    inputs: torch.Tensor                   # [B, 2 + P] int64 on the device: token id, position, pages
    staging: torch.Tensor                  # the same on the host (pinned on a GPU): filled, then one copy
    forward: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None     # the graph's output [B, vocab]
    copied: torch.cuda.Event | None = None  # the last upload from `staging` is done


def bucket_size(n: int) -> int:
    """The power of two at least n."""
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    """Static-shape decode steps for one model and KV pool, captured as CUDA graphs (or run
    eagerly with capture=False). `scratch_page` is a pool page lent to this object for its
    lifetime: padding rows write their KV there."""

    def __init__(self, model: torch.nn.Module, kv_pool: torch.Tensor, scratch_page: int, max_seqs: int,
                 capture: bool) -> None:
        if capture and kv_pool.device.type != "cuda":
            raise ConfigError("CUDA graphs need the KV pool on a CUDA device")
        self.model, self.kv_pool, self.scratch = model, kv_pool, scratch_page
        self.capture = capture
        self.max_batch = bucket_size(max_seqs)
        self.failed: str | None = None     # why capturing stopped, if it did
        self.replays = 0
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._mempool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def usable(self) -> bool:
        return self.failed is None

    def run(self, step: DecodeStep) -> torch.Tensor | None:
        """Logits [len(step.token_ids), vocab] (fp32), or None if the step's bucket could not
        be captured (graphs are off from then on: run the step eagerly)."""
        if self.capture:
            with torch.cuda.device(self.kv_pool.device):     # the pool's GPU, whichever is current
                return self._run(step)
        return self._run(step)

    def close(self) -> None:
        """Drop the graphs and their memory (the engine closes)."""
        self._buckets.clear()
        self.failed = self.failed or "closed"

    def _run(self, step: DecodeStep) -> torch.Tensor | None:
        n = len(step.token_ids)
        need = max(len(p) for p in step.pages)
        key = (bucket_size(n), bucket_size(need))
        b = self._buckets.get(key)
        if b is None:
            b = self._new_bucket(*key)
            if b is None:
                return None
        self._fill(b, step)
        if b.graph is None:
            return b.forward()[:n]
        b.graph.replay()
        self.replays += 1
        return b.logits[:n].clone()        # the next replay of any bucket may reuse its memory

    def info(self) -> dict:
        return {"capture": self.capture, "buckets": sorted(self._buckets), "replays": self.replays,
                "failed": self.failed}

    def _fill(self, b: _Bucket, step: DecodeStep) -> None:
        if b.copied is not None:
            b.copied.synchronize()         # the previous upload has left the staging buffer
        host = b.staging
        host[:, 0] = 0                     # padding rows: token 0 at position 0 in the scratch page
        host[:, 1] = 0
        host[:, 2:] = self.scratch
        n = len(step.token_ids)
        host[:n, 0] = torch.tensor(step.token_ids, dtype=torch.int64)
        host[:n, 1] = torch.tensor(step.positions, dtype=torch.int64)
        for i, pages in enumerate(step.pages):
            host[i, 2:2 + len(pages)] = torch.tensor(pages, dtype=torch.int64)
        b.inputs.copy_(host, non_blocking=True)
        if b.copied is not None:
            b.copied.record()

    def _new_bucket(self, batch: int, pages: int) -> _Bucket | None:
        dev = self.kv_pool.device
        inputs = torch.zeros(batch, 2 + pages, dtype=torch.int64, device=dev)
        inputs[:, 2:] = self.scratch
        staging = torch.empty(batch, 2 + pages, dtype=torch.int64, pin_memory=self.capture)

        def forward() -> torch.Tensor:
            return self.model(decode_batch(inputs[:, 0], inputs[:, 1], inputs[:, 2:], self.kv_pool), self.kv_pool)

        b = _Bucket(inputs, staging, forward)
        if self.capture:
            try:
                self._capture(b)
            except Exception as e:          # noqa: BLE001 - any capture failure means: run eagerly
                cause = f" (after: {e.__context__})" if e.__context__ is not None else ""
                self.failed = f"capturing a decode step of batch {batch} and {pages} pages failed: {e}{cause}"
                log.warning("kvtier: CUDA graphs are off for this engine: %s", self.failed)
                return None
        self._buckets[(batch, pages)] = b
        return b

    def _capture(self, b: _Bucket) -> None:
        dev = self.kv_pool.device
        main = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):      # warm-up off the graph: lazy init, library handles
            for _ in range(2):
                b.forward()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the store's threads (a layer-wise load, a demotion's copies) go on
            # with their own CUDA calls while this thread captures; only its own are recorded.
            with torch.cuda.graph(graph, pool=self._mempool, stream=torch.cuda.Stream(dev),
                                  capture_error_mode="thread_local"):
                logits = b.forward()
        except BaseException:
            # A capture that fails ends before torch gives back the stream and the allocator's
            # pool (CUDAGraph::capture_end raises first): hand both back, or every later
            # allocation and empty_cache() behaves as if a capture were still under way.
            torch.cuda.set_stream(main)
            end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
            if end_pool is not None:
                try:
                    end_pool(dev.index if dev.index is not None else torch.cuda.current_device(), self._mempool)
                except Exception:          # noqa: BLE001 - the pool was already closed
                    pass
            raise
        b.graph, b.logits, b.copied = graph, logits, torch.cuda.Event()
