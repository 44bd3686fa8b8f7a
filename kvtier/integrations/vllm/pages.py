"""vLLM's registered KV cache tensors -> a kvtier KVLayout and a PagedKV over them.

A kvtier block here is exactly one vLLM block (block_tokens = vLLM's block size), and its
bytes are, layer after layer, that block's page bytes as vLLM holds them: the connector
treats a page as opaque bytes and never reorders them. What the bytes mean (which
attention backend, K/V order, heads-major or token-major) is recorded in the layout's
`variant`, built from the tensors' shapes and vLLM's cache layout name, so caches that
lay their pages out differently never share keys.

Page shapes seen per layer (P = vLLM's num_blocks):

    [P, ...]          one page = one contiguous run (CPU backends: [P, kv_heads, T, 2*D];
                      MLA: [P, T, 576] or [P, 1, T, 576]; FlashInfer [P, 2, T, H, D])
    [2, P, ...]       K pages then V pages (FlashAttention): a page is two runs

The pages go to kvtier.transfer as `PagedKV.of_pages` (page format "pages"): opaque runs
of bytes, one per page or two (K, V) for [2, P, ...], moved whole and in vLLM's order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, dtype_name
from kvtier.transfer.pages import PagedKV


@dataclass(frozen=True)
class KVSpec:
    """What vLLM says about its cache (vLLM's KVCacheSpec, reduced to plain values)."""

    block_tokens: int
    num_blocks: int
    mla: bool
    num_kv_heads: int
    head_size: int
    cache_layout: str = ""           # vLLM's kv_cache_layout name, e.g. "LBHNC"


@dataclass
class VllmPages:
    """The layout of one vLLM worker's KV cache and a PagedKV over its pages."""

    layout: KVLayout
    paged: PagedKV
    layer_names: list[str]

    def layer_index(self, name: str) -> int | None:
        return self._index.get(name)

    def __post_init__(self) -> None:
        self._index = {n: i for i, n in enumerate(self.layer_names)}


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def describe_caches(kv_caches: Mapping[str, torch.Tensor], spec: KVSpec,
                    layer_names: Sequence[str] | None = None) -> VllmPages:
    """Check vLLM's per-layer caches and derive the kvtier layout (its fingerprint covers
    the page shape, dtype, layer count, block size and vLLM's cache layout name)."""
    names = [n for n in (layer_names or kv_caches) if n in kv_caches]
    if not names:
        raise ConfigError("vLLM registered no KV cache tensors: the kvtier connector needs an attention model")
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    for n, t in zip(names, tensors):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ConfigError(f"KV cache of layer {n} is {_shape(t)} {t.dtype} on {t.device} but {names[0]}'s is "
                              f"{_shape(first)} {first.dtype} on {first.device}: the kvtier connector needs one "
                              "cache shape for every layer (hybrid models are not supported)")
        if not t.is_contiguous():
            raise ConfigError(f"KV cache of layer {n} ({_shape(t)}, strides {t.stride()}) is not contiguous: the kvtier "
                              "connector needs per-layer contiguous caches (cross-layer layouts are not supported)")
    dtype_name(first.dtype)       # a LayoutError for dtypes kvtier cannot store
    P, T = spec.num_blocks, spec.block_tokens
    if first.dim() >= 2 and first.shape[0] == 2 and first.shape[1] == P:
        runs, page_shape = 2, tuple(first.shape[2:])
    elif first.shape[0] == P:
        runs, page_shape = 1, tuple(first.shape[1:])
    else:
        raise ConfigError(f"KV cache shape {_shape(first)} has neither {P} pages first nor [2, {P}, ...]: "
                          "this attention backend's layout is not supported by the kvtier connector")
    elems = 1
    for d in page_shape:
        elems *= d
    page_bytes = runs * elems * first.element_size()
    L = len(names)
    variant = (f"vllm:{spec.cache_layout or '?'}:{'kv-split' if runs == 2 else 'page'}:"
               f"[{', '.join(map(str, page_shape))}]")
    if spec.mla:
        width = spec.head_size
        if runs != 1 or page_bytes != T * width * first.element_size():
            raise ConfigError(f"MLA cache pages {_shape(first)} do not hold {T} tokens x {width} values")
        rope = 64 if width > 64 else width // 2
        layout = KVLayout.mla(L, kv_lora_rank=width - rope, rope_dim=rope, block_tokens=T, dtype=first.dtype,
                              variant=variant)
    else:
        H, D = spec.num_kv_heads, spec.head_size
        if page_bytes != 2 * T * H * D * first.element_size():
            raise ConfigError(f"KV cache pages {_shape(first)} are {page_bytes} bytes, not K and V of {T} tokens x "
                              f"{H} heads x {D} ({first.dtype}): padded or quantized caches are not supported")
        layout = KVLayout.mha(L, num_kv_heads=H, head_dim=D, block_tokens=T, dtype=first.dtype, variant=variant)
    return VllmPages(layout, PagedKV.of_pages(tensors, layout, P), names)
