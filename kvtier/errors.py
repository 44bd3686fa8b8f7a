"""The library's exception types: every error kvtier raises on bad input is one of these.

Each message says what was wrong and what to do about it, so a caller can act on it
without reading kvtier's source.
"""
from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is malformed or out of range (capacity, policy name, ...)."""


class LayoutError(KvtierError, ValueError):
    """A tensor does not match the store's KV layout (dtype, shape, device, size)."""


class CapacityError(KvtierError):
    """A request cannot fit in a tier however much is evicted (e.g. a put larger than the tier)."""


class ForeignKeysError(ConfigError):
    """Keys made by a store of another namespace, layout or hash were given to this store.

    Such keys name other blocks: they would never hit, and a put would file blocks under
    names no request of this store ever asks for."""


class TierSizeError(ConfigError, CapacityError):
    """A tier's configured size cannot work: smaller than one block, larger than the
    machine's memory or the disk's free space. A setting to change (exit 2 in the CLI)."""


class TierInUseError(ConfigError):
    """A disk tier's directory is held by another live store (this process or another): one
    store at a time writes a directory."""


class KeyNotCachedError(KvtierError, LookupError):
    """get() was asked for a block the store does not hold (call lookup() first)."""


class ClosedError(KvtierError, RuntimeError):
    """The store or tier was closed and cannot serve requests any more."""


class TransferError(KvtierError, RuntimeError):
    """A copy between memories failed; the blocks involved were not published."""


class TraceError(ConfigError):
    """A trace file is missing, empty, of an unknown format, or has a malformed line."""

    def __init__(self, path: str, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.line = line


class WriteInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM in the CLI) came while a tier wrote blocks: the write was finished
    and recorded before it was let through, so the caller keeps the blocks and stops. (An
    eviction written down as Ctrl-C came was dropped: blocks a put had acknowledged lost.)"""
