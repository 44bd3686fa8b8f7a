"""The checksum of a block's bytes (xxh3-64): recorded with every block on disk and sent
with every block between nodes, checked on every read from either; a mismatch is a miss.

The C version (kvtier/_chain.c, built by `pip install` where a compiler exists) releases
the GIL while it hashes a large block, so I/O threads writing or reading other blocks keep
running; on x86 it takes xxHash's runtime dispatch (AVX2 where the CPU has it). python-xxhash,
the fallback, gives the same values but holds the GIL.
"""
from __future__ import annotations

from typing import Callable, Sequence

try:
    from kvtier._chain import xxh3_64 as _native
    from kvtier._chain import xxh3_64_many as _native_many
except ImportError:     # no C compiler at install time
    _native = _native_many = None

if _native is not None:
    block_checksum: Callable[[object], int] = _native
    # Speed: many blocks under one release of the GIL (see _chain.c: a put's I/O threads
    # waited for the GIL once per block while this thread hashed).
    block_checksums: Callable[[Sequence[object]], list[int]] = _native_many
else:
    import xxhash
    block_checksum = xxhash.xxh3_64_intdigest     # the same values

    def block_checksums(blocks: Sequence[object]) -> list[int]:
        """block_checksum of each block."""
        return [block_checksum(b) for b in blocks]
