"""Copiers between memories: engine pages <-> kvtier blocks, host <-> GPU.

- gather / scatter (pages.py): an engine's paged KV (vLLM, FlashInfer or MLA page
  layouts, one tensor per layer) <-> contiguous layer-major blocks, one CUDA launch per
  call on a GPU (csrc/paged_copy.cu, compiled at run time), torch ops otherwise.
- LayerLoader / Saver (streams.py): host blocks -> engine pages layer by layer on a side
  stream (wait_for_layer(i)), and engine pages -> host blocks without blocking the engine.
See docs/gpu.md.
"""
from kvtier.transfer.pages import PAGE_FORMATS, PagedKV, gather, scatter
from kvtier.transfer.streams import LayerLoader, LoadHandle, SaveHandle, Saver

__all__ = ["PAGE_FORMATS", "PagedKV", "gather", "scatter", "LayerLoader", "LoadHandle", "Saver", "SaveHandle"]
