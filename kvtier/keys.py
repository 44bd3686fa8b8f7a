"""Token ids -> chained 128-bit block keys, seeded by a namespace.

key_i = H(key_{i-1} || token bytes of block i), truncated to 16 bytes, where key_{-1} is
the namespace seed: H(model, revision, layout fingerprint, shard, tenant salt, hash
name). So a key names its block *and* everything before it, two requests that share key
k share the whole prefix up to k, and stores of different models, layouts or tenants
never share a key. Tokens are hashed as little-endian uint32, the same bytes on every
machine; nothing depends on Python's hash() or PYTHONHASHSEED.

Only full blocks are keyed: a partial trailing block is left out. Token ids must be
integers in [0, 2**32): floats (even whole ones), booleans, strings and out-of-range ids
are refused, never truncated or wrapped into another token's id.

Keys made by a store's Keyer remember their origin (KeyOrigin: the namespace, layout and
hash behind the seed), so a store can refuse another store's keys with one comparison
per call instead of silently missing on them. Keys from elsewhere (a peer, a trace, a
plain list) carry no origin and are accepted as they are.
"""
from __future__ import annotations

import array
import hashlib
import numbers
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, SupportsIndex, overload

import msgpack
import numpy as np
import xxhash

from kvtier.errors import ConfigError, ForeignKeysError, LayoutError
from kvtier.ids import KEY_BYTES, BlockKey as Key
from kvtier.shard import check_shard

if TYPE_CHECKING:    # keys need no torch: trace replays and the CLI stay light
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

# array.array's code for a 4-byte unsigned int (None on a platform without one).
_U32 = next((c for c in "IL" if array.array(c).itemsize == 4), None)

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
        check_shard(self.shard)     # a typo would be a namespace of its own that never hits

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


@dataclass(frozen=True, eq=False)
class KeyOrigin:
    """Who made a chain of keys: the namespace, layout and hash its seed was derived from.

    One per Keyer, shared by every BlockKeys it makes (and their slices). Two origins are
    the same identity when their seeds are equal, e.g. two stores opened on one model."""

    seed: Key
    namespace: Namespace
    layout: KVLayout
    hash_name: str

    def matches(self, other: KeyOrigin) -> bool:
        """Whether keys of `other` name blocks of this origin (the same seed)."""
        return other is self or other.seed == self.seed

    def describe(self) -> str:
        ns = self.namespace
        return (f"model={ns.model!r}, revision={ns.revision!r}, shard={ns.shard!r}, "
                f"layout {self.layout.describe()}, hash {self.hash_name}")

    def differences(self, other: KeyOrigin) -> list[str]:
        """What differs between `other` (the keys') and this origin (the store's), in words."""
        a, b = other.namespace, self.namespace
        out = [f"{name} {x!r} (this store: {y!r})" for name, x, y in (
            ("model", a.model, b.model), ("revision", a.revision, b.revision), ("shard", a.shard, b.shard))
            if x != y]
        if bytes(a.salt) != bytes(b.salt):
            out.append("another tenant salt")
        if other.layout.fingerprint != self.layout.fingerprint:
            la, lb = other.layout.describe(), self.layout.describe()
            if la == lb:
                la, lb = f"variant {other.layout.variant!r}", f"variant {self.layout.variant!r}"
            out.append(f"layout {la} (this store: {lb})")
        if other.hash_name != self.hash_name:
            out.append(f"hash {other.hash_name} (this store: {self.hash_name})")
        return out or ["another namespace seed"]

    def refuse(self, other: KeyOrigin, what: str = "keys") -> ForeignKeysError:
        """The error for `what` made by `other` given to a store of this origin."""
        return ForeignKeysError(
            f"these {what} were made by another store's keys(): {'; '.join(self.differences(other))}. "
            "Keys name blocks of one model, layout and tenant and never match another's: "
            "make them with this store's keys(tokens)")


def _joined(a: KeyOrigin | None, b: KeyOrigin | None) -> KeyOrigin | None:
    """The origin of keys joined from two runs: shared, None if either is unknown; two
    different stores' keys are never joined."""
    if a is None or b is None:
        return None
    if not a.matches(b):
        raise a.refuse(b, "keys being joined")
    return a


class BlockKeys(list):
    """The keys of consecutive full blocks of one prompt, in prefix order.

    A plain list of 16-byte keys that also remembers where it sits in its chain:
    `start` is the index of its first block in the prompt and `parent` the key just
    before it (the namespace seed for a chain's first block). Slicing keeps both, and a
    reference to the whole chain, so `store.put(keys[hit:], ...)` still knows each
    block's depth and parent and can refresh the prefix before it.

    `origin` (a KeyOrigin, or None when unknown) says which store identity made the keys;
    a store refuses keys of another origin. Slices keep it, and so does `a + b` when b
    continues a's chain (anything else joined is a plain list, as for lists).
    """

    __slots__ = ("parent", "start", "origin", "_base")

    def __init__(self, keys: Iterable[Key] = (), parent: Key = b"", start: int = 0,
                 base: BlockKeys | None = None, origin: KeyOrigin | None = None) -> None:
        super().__init__(keys)
        self.parent = parent
        self.start = start
        self.origin = origin
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
                             base=self._base if self._base is not None else self, origin=self.origin)
        return list.__getitem__(self, i)

    def __add__(self, other: object) -> list[Key]:  # type: ignore[override]
        """`keys + more`: a BlockKeys when `more` continues this chain (keys(tokens,
        parent=keys) or a following slice), else a plain list. Keys of two different
        stores are never joined (ForeignKeysError)."""
        if not isinstance(other, BlockKeys):
            return list.__add__(self, other)  # type: ignore[operator]
        origin = _joined(self.origin, other.origin)
        if other.start == self.start + len(self) and other.parent == self.last:
            return BlockKeys(list.__add__(self, other), parent=self.parent, start=self.start,
                             base=self._base, origin=origin)
        return list(self) + list(other)

    def copy(self) -> BlockKeys:  # type: ignore[override]
        """A copy that keeps the chain and origin, as keys[:] does (list.copy made a plain list)."""
        return self[:]

    def __iadd__(self, other: Iterable[Key]) -> BlockKeys:  # type: ignore[override]
        if isinstance(other, BlockKeys):
            _joined(self.origin, other.origin)
        return list.__iadd__(self, other)

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
        who = f", model={self.origin.namespace.model!r}" if self.origin is not None else ""
        return f"BlockKeys(n={len(self)}, start={self.start}{who})"


def token_bytes(tokens: object) -> bytes:
    """Canonical bytes of a token id sequence: little-endian uint32.

    Accepts a 1-D sequence of ints: a list or tuple, an integer numpy array or an integer
    tensor (any device). Ids must be in [0, 2**32). Floats (even whole ones: a float32 id
    above 2**24 is already another id), booleans, strings and other objects are refused
    with a LayoutError naming the first bad value, never truncated."""
    if isinstance(tokens, (bytes, bytearray, memoryview, str)):
        raise LayoutError("tokens must be a sequence of int token ids, not bytes or a string: tokenize text first")
    torch = sys.modules.get("torch")   # a tensor means torch is imported: never import it here
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.ndim == 1 and tokens.numel() == 0:
            return b""   # torch.tensor([]) is float32: no ids, nothing to refuse
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise LayoutError(f"token ids must be integers, got a {tokens.dtype} tensor: "
                              "pass an integer tensor (tensor.long() if its values are whole numbers)")
        if tokens.is_meta:
            raise LayoutError("tokens on the meta device have no values: pass the real token ids")
        tokens = tokens.detach().cpu().numpy()
    if _U32 is not None and isinstance(tokens, (list, tuple, range)):
        # Speed: a list of ints straight into uint32, ~3x faster than through numpy, and
        # as strict: a float, string or None is a TypeError, an id out of range an
        # OverflowError; those lists go on to numpy below, which says what was wrong.
        try:
            u32 = array.array(_U32, tokens)
        except (TypeError, OverflowError):
            pass
        else:
            if sys.byteorder != "little":
                u32.byteswap()
            return u32.tobytes()
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.array(tokens)   # its dtype says what the values were: checked below
        except (TypeError, ValueError, OverflowError) as e:
            why = str(e).split(". ")[0]   # numpy's first sentence, e.g. a ragged nested list
            raise LayoutError(f"tokens must be a flat sequence of int token ids: {why}") from None
    if arr.ndim == 0:       # None, one int, a generator: numpy makes a scalar of it
        got = "an iterator: make a list of it" if hasattr(tokens, "__next__") else type(tokens).__name__
        raise LayoutError(f"tokens must be a list, array or tensor of int token ids, got {got}")
    if arr.ndim != 1:
        raise LayoutError(f"tokens must be a one-dimensional sequence of ids, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind not in "iu":
        if arr.size == 0:
            return b""       # no ids (an empty list is float64 to numpy, torch.tensor([]) float32)
        raise LayoutError(_not_integer_ids(arr, tokens))
    # Speed: uint8/16/32 ids are in range by their type: no scan of a long prompt.
    if arr.size and not (kind == "u" and arr.dtype.itemsize <= 4):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFFFFFF:
            i = int(np.argmax((arr < 0) | (arr > 0xFFFFFFFF)))
            raise LayoutError(f"token ids must be in [0, 2**32), got {int(arr[i])} at position {i}")
    return arr.astype("<u4", copy=False).tobytes()


def _not_integer_ids(arr: np.ndarray, tokens: object) -> str:
    """Why `tokens` (read by numpy as `arr`, non-empty, of a non-integer dtype) are not
    token ids, in words: the first bad value and its position where there is one."""
    kind = arr.dtype.kind
    if kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.trunc(arr)))
        if bad.size:
            i = int(bad[0])
            return (f"token ids must be integers, got {arr[i].item()!r} at position {i}: a fractional id "
                    "is not a token (it is never rounded into another token's id)")
        where = ""
        if isinstance(tokens, (list, tuple)):       # a list with a float among ints: name it
            i = next((i for i, t in enumerate(tokens) if not isinstance(t, numbers.Integral)), None)
            where = f" ({tokens[i]!r} at position {i})" if i is not None else ""
        return (f"token ids must be integers, got {arr.dtype} values{where}: convert whole-number ids first "
                "(np.asarray(ids, dtype=np.int64), tensor.long(), [int(t) for t in ids])")
    if kind == "b":
        return "token ids must be integers, got booleans (True/False)"
    if kind in "USO":    # strings, None, ids too large for numpy's ints, other objects
        items = tokens if isinstance(tokens, (list, tuple)) else arr.tolist()
        for i, t in enumerate(items):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                hint = ": tokenize text first" if isinstance(t, (str, bytes)) else ""
                return f"token ids must be integers, got {t!r} ({type(t).__name__}) at position {i}{hint}"
            if not 0 <= t <= 0xFFFFFFFF:
                return f"token ids must be in [0, 2**32), got {t} at position {i}"
    return f"token ids must be integers, got values of dtype {arr.dtype}"


def chain_keys(tokens: object, block_tokens: int, parent: Key, hash_name: str = "xxh3",
               start: int = 0, origin: KeyOrigin | None = None) -> BlockKeys:
    """Keys of every full block of `tokens`, chained from `parent`, tagged with `origin`."""
    if block_tokens <= 0:
        raise ConfigError(f"block_tokens must be positive, got {block_tokens}")
    if len(parent) != KEY_BYTES:
        raise ConfigError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    data = token_bytes(tokens)
    if hash_name == "xxh3" and _chain_xxh3 is not None:
        # The same digests as below, chained in one C call (~10x faster).
        return BlockKeys(_chain_xxh3(data, block_tokens, parent), parent=parent, start=start, origin=origin)
    step = 4 * block_tokens
    end = len(data) - len(data) % step   # partial trailing block is not keyed
    h = _hasher(hash_name)
    p = parent
    # Speed: one bytes concat and one C hash call per block, in a comprehension
    # (cheaper than an explicit loop); 8,192 blocks of a 128k prompt take ~1 ms.
    keys = [p := h(p + data[i:i + step]) for i in range(0, end, step)]
    return BlockKeys(keys, parent=parent, start=start, origin=origin)


class Keyer:
    """Turns token ids into block keys for one namespace, layout and hash."""

    def __init__(self, namespace: Namespace, layout: KVLayout, hash_name: str = "xxh3") -> None:
        self.block_tokens = layout.block_tokens
        self.hash_name = hash_name
        self.seed = namespace.seed(layout, hash_name)
        self.origin = KeyOrigin(self.seed, namespace, layout, hash_name)

    def __call__(self, tokens: object, parent: BlockKeys | None = None) -> BlockKeys:
        """Keys of the full blocks of `tokens`; with `parent`, `tokens` continue that chain
        (the result has parent's origin: none if parent came from elsewhere)."""
        if parent is None:
            return chain_keys(tokens, self.block_tokens, self.seed, self.hash_name, origin=self.origin)
        if not isinstance(parent, BlockKeys):
            raise LayoutError(f"parent must be the BlockKeys of the blocks before these tokens (what keys() "
                              f"returned for them), not {type(parent).__name__}")
        self.check(parent, "parent keys")
        return chain_keys(tokens, self.block_tokens, parent.last, self.hash_name,
                          start=parent.start + len(parent), origin=parent.origin)

    def check(self, keys: BlockKeys, what: str = "keys") -> None:
        """Refuse BlockKeys made by another store's keyer (ForeignKeysError); one comparison."""
        o = keys.origin
        if o is not None and o is not self.origin and o.seed != self.seed:
            raise self.origin.refuse(o, what)
