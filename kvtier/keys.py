"""Token ids -> chained 128-bit block keys, seeded by a namespace.

key_i = H(key_{i-1} || token bytes of block i), truncated to 16 bytes, where key_{-1} is
the namespace seed: H(model, revision, layout fingerprint, shard, tenant salt, hash
name). So a key names its block *and* everything before it, two requests that share key
k share the whole prefix up to k, and stores of different models, layouts or tenants
never share a key. Tokens are hashed as little-endian uint32, the same bytes on every
machine; nothing depends on Python's hash() or PYTHONHASHSEED.

Only full blocks are keyed: a partial trailing block is left out.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Callable, Iterable, SupportsIndex, overload

import msgpack
import numpy as np
import xxhash

from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVLayout

# The optional C accelerator for xxh3 chains (kvtier/_chain.c, built by `pip install`
# where a C compiler exists). KVTIER_NO_NATIVE=1 forces the pure-Python path.
_chain_xxh3: Callable[[bytes, int, bytes], list[bytes]] | None = None
if os.environ.get("KVTIER_NO_NATIVE", "") in ("", "0"):
    try:
        from kvtier._chain import chain_xxh3 as _chain_xxh3
    except ImportError:  # not built (no compiler): the Python path below
        _chain_xxh3 = None
NATIVE: bool = _chain_xxh3 is not None  # True when xxh3 keys are chained in C

Key = bytes  # 16 bytes
KEY_BYTES = 16
HASHES = ("xxh3", "sha256", "blake3")


def _hasher(name: str) -> Callable[[bytes], bytes]:
    """A function bytes -> 16-byte digest for the named hash."""
    if name == "xxh3":
        return xxhash.xxh3_128_digest
    if name == "sha256":
        sha = hashlib.sha256
        return lambda b: sha(b).digest()[:KEY_BYTES]
    if name == "blake3":
        try:
            from blake3 import blake3
        except ImportError as e:  # optional extra
            raise ConfigError("hash='blake3' needs the blake3 package: pip install 'kvtier[blake3]'") from e
        return lambda b: blake3(b).digest(KEY_BYTES)
    raise ConfigError(f"unknown hash {name!r}; choose one of {', '.join(HASHES)} "
                      "(xxh3 is fastest; sha256 or blake3 for stores shared by untrusted tenants)")


@dataclass(frozen=True)
class Namespace:
    """Who the cached KV belongs to: blocks from different namespaces never share keys."""

    model: str
    revision: str = ""
    shard: str = ""          # tensor/pipeline-parallel shard, e.g. "tp0/8"
    salt: bytes = b""        # tenant salt: tenants with different salts never share blocks

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("Namespace.model must be a non-empty string (the model id)")
        if not isinstance(self.salt, (bytes, bytearray)):
            raise ConfigError(f"Namespace.salt must be bytes, got {type(self.salt).__name__}")

    def seed(self, layout: KVLayout, hash_name: str = "xxh3") -> Key:
        """key_{-1}: the 16-byte root of every key chain in this namespace and layout."""
        packed = msgpack.packb(
            ["kvtier-ns-v1", self.model, self.revision, self.shard, bytes(self.salt),
             layout.fingerprint, hash_name], use_bin_type=True)
        return _hasher(hash_name)(packed)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def checkpoint_revision(path: str | os.PathLike, sample_bytes: int = 1 << 20) -> str:
    """A Namespace revision for a checkpoint folder: a digest of its config.json and, per
    weight file, its name, size and first and last `sample_bytes` (a safetensors header is
    at the start). A checkpoint rewritten in place (a fine-tune) gets another revision, so
    its KV never mixes with the old weights'; hashing a terabyte of weights would take minutes."""
    folder = os.fspath(path)
    h = hashlib.sha256()
    cfg = os.path.join(folder, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as fh:
            h.update(fh.read())
    for name in sorted(os.listdir(folder)):
        f = os.path.join(folder, name)
        if not name.endswith(WEIGHT_SUFFIXES) or not os.path.isfile(f):
            continue
        size = os.path.getsize(f)
        h.update(f"{name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(sample_bytes))
            fh.seek(max(0, size - sample_bytes))
            h.update(fh.read(sample_bytes))
    return "ckpt-" + h.hexdigest()[:16]


class BlockKeys(list):
    """The keys of consecutive full blocks of one prompt, in prefix order.

    A plain list of 16-byte keys that also remembers where it sits in its chain:
    `start` is the index of its first block in the prompt and `parent` the key just
    before it (the namespace seed for a chain's first block). Slicing keeps both, and a
    reference to the whole chain, so `store.put(keys[hit:], ...)` still knows each
    block's depth and parent and can refresh the prefix before it.
    """

    __slots__ = ("parent", "start", "_base")

    def __init__(self, keys: Iterable[Key] = (), parent: Key = b"", start: int = 0,
                 base: BlockKeys | None = None) -> None:
        super().__init__(keys)
        self.parent = parent
        self.start = start
        self._base = base  # the chain this is a slice of (None: itself)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Key: ...
    @overload
    def __getitem__(self, i: slice) -> BlockKeys: ...
    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            if step != 1:
                return list.__getitem__(self, i)  # not a chain any more
            parent = list.__getitem__(self, lo - 1) if lo > 0 else self.parent
            return BlockKeys(list.__getitem__(self, i), parent=parent, start=self.start + lo,
                             base=self._base if self._base is not None else self)
        return list.__getitem__(self, i)

    def prefix(self) -> list[Key]:
        """The keys of the chain before this slice (empty for a whole chain)."""
        base = self._base
        if base is None:
            return []
        return list.__getitem__(base, slice(0, self.start - base.start))

    @property
    def last(self) -> Key:
        """The key to continue this chain from (the parent of the next block)."""
        return list.__getitem__(self, -1) if self else self.parent

    def __repr__(self) -> str:
        return f"BlockKeys(n={len(self)}, start={self.start})"


def token_bytes(tokens: object) -> bytes:
    """Canonical bytes of a token id sequence: little-endian uint32."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise LayoutError("tokens must be a sequence of ints, not bytes")
    try:
        import torch
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a core dependency
        pass
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise LayoutError(f"tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise LayoutError(f"tokens must be integers, got dtype {tokens.dtype}")
        arr = tokens
    else:
        try:
            arr = np.array(tokens, dtype=np.int64)
        except (TypeError, ValueError, OverflowError) as e:
            raise LayoutError(f"tokens must be a sequence of ints: {e}") from None
        if arr.ndim != 1:
            raise LayoutError(f"tokens must be a flat sequence of ints, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise LayoutError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_keys(tokens: object, block_tokens: int, parent: Key, hash_name: str = "xxh3",
               start: int = 0) -> BlockKeys:
    """Keys of every full block of `tokens`, chained from `parent`."""
    if block_tokens <= 0:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    if len(parent) != KEY_BYTES:
        raise ConfigError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    data = token_bytes(tokens)
    if hash_name == "xxh3" and _chain_xxh3 is not None:
        # The same digests as below, chained in one C call (~10x faster).
        return BlockKeys(_chain_xxh3(data, block_tokens, parent), parent=parent, start=start)
    step = 4 * block_tokens
    end = len(data) - len(data) % step   # partial trailing block is not keyed
    h = _hasher(hash_name)
    p = parent
    # Speed: one bytes concat and one C hash call per block, in a comprehension
    # (cheaper than an explicit loop); 8,192 blocks of a 128k prompt take ~1 ms.
    keys = [p := h(p + data[i:i + step]) for i in range(0, end, step)]
    return BlockKeys(keys, parent=parent, start=start)


class Keyer:
    """Turns token ids into block keys for one namespace, layout and hash."""

    def __init__(self, namespace: Namespace, layout: KVLayout, hash_name: str = "xxh3") -> None:
        self.block_tokens = layout.block_tokens
        self.hash_name = hash_name
        self.seed = namespace.seed(layout, hash_name)

    def __call__(self, tokens: object, parent: BlockKeys | None = None) -> BlockKeys:
        """Keys of the full blocks of `tokens`; with `parent`, `tokens` continue that chain."""
        if parent is None:
            return chain_keys(tokens, self.block_tokens, self.seed, self.hash_name)
        return chain_keys(tokens, self.block_tokens, parent.last, self.hash_name,
                          start=parent.start + len(parent))
