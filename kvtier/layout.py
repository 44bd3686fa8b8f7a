"""What one KV block holds: its shape, bytes, per-layer ranges and fingerprint.

A block is `block_tokens` tokens of KV for every layer, stored layer-major so that one
layer of a block is one contiguous byte range (a loader can hand layer i to the engine
while layer i+1 is still in flight).

- MHA/GQA: per layer, K then V, each `[block_tokens, num_kv_heads, head_dim]`.
- MLA (DeepSeek-V3, Kimi K2): per layer `[block_tokens, kv_lora_rank + rope_dim]`,
  the normalised latent followed by the roped key part, as engines page it.

The fingerprint hashes every field, so blocks of different layouts can never share keys.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgpack
import torch
import xxhash

from kvtier.errors import ConfigError, LayoutError
from kvtier.presets import LAYOUT_PRESETS

# Bumped whenever the byte layout inside a block changes meaning.
LAYOUT_FORMAT = 1

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8,
}


_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def dtype_from_name(name: str, allowed: tuple[str, ...] | None = None) -> torch.dtype:
    """The torch dtype named `name` ("bfloat16", or an alias: "bf16", "fp32", ...); a
    ConfigError naming the choices when it is unknown or not in `allowed`."""
    canon = _ALIASES.get(name, name) if isinstance(name, str) else name
    choices = allowed or tuple(_DTYPES)
    if canon not in choices:
        raise ConfigError(f"dtype {name!r} is not supported here; use one of {', '.join(choices)}")
    return _DTYPES[canon]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported dtype ("bfloat16"), or a LayoutError."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    if isinstance(dtype, str):
        raise LayoutError(f"dtype must be a torch.dtype (torch.{_ALIASES.get(dtype, dtype)}), not the string {dtype!r}")
    raise LayoutError(f"unsupported KV dtype {dtype}; use one of {', '.join(_DTYPES)}")


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block of KV cache. Build one with `KVLayout.mha` or `KVLayout.mla`."""

    kind: Literal["mha", "mla"]
    num_layers: int
    block_tokens: int
    dtype: torch.dtype
    num_kv_heads: int = 0     # mha only
    head_dim: int = 0         # mha only
    kv_lora_rank: int = 0     # mla only
    rope_dim: int = 0         # mla only
    # Free-form engine-specific layout choices (e.g. "rope-deinterleaved"): any change
    # here changes the fingerprint, so engines that store bytes differently never mix.
    variant: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "mla"):
            raise ConfigError(f"layout kind must be 'mha' or 'mla', got {self.kind!r}")
        _positive("num_layers", self.num_layers)
        _positive("block_tokens", self.block_tokens)
        dtype_name(self.dtype)
        if self.kind == "mha":
            _positive("num_kv_heads", self.num_kv_heads)
            _positive("head_dim", self.head_dim)
        else:
            _positive("kv_lora_rank", self.kv_lora_rank)
            _positive("rope_dim", self.rope_dim)

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_tokens: int,
            dtype: torch.dtype = torch.bfloat16, variant: str = "") -> KVLayout:
        """Multi-head or grouped-query attention: K and V per layer."""
        return cls("mha", num_layers, block_tokens, dtype, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, variant=variant)

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, rope_dim: int, block_tokens: int,
            dtype: torch.dtype = torch.bfloat16, variant: str = "") -> KVLayout:
        """Multi-head latent attention: the latent and the rope key per layer."""
        return cls("mla", num_layers, block_tokens, dtype, kv_lora_rank=kv_lora_rank,
                   rope_dim=rope_dim, variant=variant)

    # -- sizes ---------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer of one block, in elements of `dtype`."""
        if self.kind == "mha":
            return (2, self.block_tokens, self.num_kv_heads, self.head_dim)
        return (self.block_tokens, self.kv_lora_rank + self.rope_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block, layer-major: (num_layers, *layer_shape)."""
        return (self.num_layers, *self.layer_shape)

    @property
    def layer_bytes(self) -> int:
        n = 1
        for d in self.layer_shape:
            n *= d
        return n * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_tokens

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(offset, nbytes) of one layer inside a block."""
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} out of range: this layout has {self.num_layers} layers")
        return layer * self.layer_bytes, self.layer_bytes

    # -- identity ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["dtype"] = dtype_name(self.dtype)
        d["format"] = LAYOUT_FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        d = dict(d)
        fmt = d.pop("format", LAYOUT_FORMAT)
        if fmt != LAYOUT_FORMAT:
            raise LayoutError(f"layout format {fmt} is not supported by this kvtier (format {LAYOUT_FORMAT})")
        if d.get("dtype") not in _DTYPES:
            raise LayoutError(f"unknown dtype {d.get('dtype')!r} in layout")
        d["dtype"] = _DTYPES[d["dtype"]]
        return cls(**d)

    @property
    def fingerprint(self) -> bytes:
        """16 bytes that change with any field; part of every block key's namespace seed."""
        packed = msgpack.packb(sorted(self.to_dict().items()), use_bin_type=True)
        return xxhash.xxh3_128_digest(packed)

    def describe(self) -> str:
        if self.kind == "mha":
            what = f"MHA {self.num_layers}L x {self.num_kv_heads}h x {self.head_dim}d"
        else:
            what = f"MLA {self.num_layers}L x ({self.kv_lora_rank}+{self.rope_dim})"
        return (f"{what}, {dtype_name(self.dtype)}, {self.block_tokens} tokens/block, "
                f"{self.block_bytes} B/block")


# Named layouts for the CLI and benchmarks (block_tokens is set by the caller).
def preset_layout(name: str, block_tokens: int) -> KVLayout:
    """A named layout ("kimi-k2", "llama3-8b", ...) at the given block size."""
    if name not in LAYOUT_PRESETS:
        raise ConfigError(f"unknown layout preset {name!r}; choose one of {', '.join(LAYOUT_PRESETS)}")
    spec = dict(LAYOUT_PRESETS[name])
    return KVLayout(block_tokens=block_tokens, **{**spec, "dtype": _DTYPES[spec["dtype"]]})
