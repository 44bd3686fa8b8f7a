"""What a caller may pass as blocks to put() or as `out` to get(), checked at the boundary.

Accepted: a contiguous CPU tensor (or numpy array) `[n, ...]` whose rows are one block
each, of dtype uint8 (`[n, layout.block_bytes]`) or the layout's dtype
(`[n, *layout.block_shape]`); or a list of n such single-block tensors. Everything is
turned into uint8 numpy row views of the same memory: no copy is made here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvtier.errors import LayoutError
from kvtier.layout import KVLayout, dtype_name

Rows = Sequence[np.ndarray]


def _tensor_bytes(t: torch.Tensor, what: str, layout: KVLayout, writable: bool) -> np.ndarray:
    if t.device.type != "cpu":
        raise LayoutError(
            f"{what} is on {t.device}; the host tier copies to and from CPU memory only in this "
            "version: pass CPU tensors (GPU pages go through the device transfer path)")
    if t.dtype not in (torch.uint8, layout.dtype):
        raise LayoutError(f"{what} has dtype {t.dtype}; expected torch.uint8 or the layout's "
                          f"{dtype_name(layout.dtype)}")
    if not t.is_contiguous():
        raise LayoutError(f"{what} is not contiguous: pass a contiguous tensor (e.g. .contiguous())"
                          + ("" if not writable else " so the store can fill it in place"))
    if writable and t.requires_grad:
        raise LayoutError(f"{what} requires grad: pass a tensor without autograd to fill")
    flat = t.detach().reshape(-1)
    if t.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def as_rows(blocks: object, n: int, layout: KVLayout, what: str = "blocks", writable: bool = False) -> Rows:
    """Validate `blocks` as n blocks of `layout` and return n uint8 row views of it."""
    bb = layout.block_bytes
    if isinstance(blocks, (torch.Tensor, np.ndarray)):
        if blocks.ndim == 0 or blocks.shape[0] != n:
            shape = tuple(blocks.shape)
            raise LayoutError(f"{what} has shape {shape} but {n} blocks were given keys: "
                              f"expected [{n}, {bb}] uint8 or [{n}, {', '.join(map(str, layout.block_shape))}] "
                              f"{dtype_name(layout.dtype)}")
        if isinstance(blocks, np.ndarray):
            if blocks.dtype != np.uint8 or not blocks.flags.c_contiguous:
                raise LayoutError(f"{what}: numpy blocks must be C-contiguous uint8 [{n}, {bb}]")
            raw = blocks.reshape(-1)
        else:
            raw = _tensor_bytes(blocks, what, layout, writable)
            # A tensor of the layout's dtype must have its block shape: one with the same
            # element count in another order ([n, L, T, 2, ...] for [n, L, 2, T, ...]) would be
            # stored as its raw bytes, and every later load would hand back scrambled KV.
            if (blocks.dtype == layout.dtype and blocks.dtype != torch.uint8
                    and tuple(blocks.shape[1:]) != tuple(layout.block_shape)):
                raise LayoutError(
                    f"{what} has shape {tuple(blocks.shape)} but this layout's block is "
                    f"[{', '.join(map(str, layout.block_shape))}] {dtype_name(layout.dtype)} ({layout.describe()}): "
                    f"pass [{n}, {', '.join(map(str, layout.block_shape))}] in that order (permute your tensor "
                    f"and make it contiguous), or its bytes as uint8 [{n}, {bb}]")
        if raw.size != n * bb:
            raise LayoutError(f"{what} holds {raw.size} bytes = {raw.size / max(n, 1):.0f} per block; "
                              f"this layout's block is {bb} bytes ({layout.describe()})")
        if writable and not raw.flags.writeable:
            raise LayoutError(f"{what} is read-only: pass a writable buffer to fill")
        return raw.reshape(n, bb)
    if isinstance(blocks, (list, tuple)):
        if len(blocks) != n:
            raise LayoutError(f"{what} has {len(blocks)} blocks but {n} keys were given")
        rows = []
        for i, b in enumerate(blocks):
            if not isinstance(b, (torch.Tensor, np.ndarray)):
                raise LayoutError(f"{what}[{i}] is a {type(b).__name__}; expected a tensor of one block")
            batched = b.ndim in (2, 1 + len(layout.block_shape)) and b.shape[0] == 1    # [1, ...] already
            one = b if batched else b.reshape(1, *b.shape)
            r = as_rows(one, 1, layout, f"{what}[{i}]", writable)
            rows.append(r[0])
        return rows
    raise LayoutError(f"{what} must be a tensor [n, block_bytes] or a list of n block tensors, "
                      f"not {type(blocks).__name__}")
