"""LMDB files shorter than their newest transaction: made safe to open.

LMDB maps its data file into memory, and a read of a page past the end of the file is a
SIGBUS that kills the process with no message. Two things leave a file shorter than the
last page its newest meta page counts (mm_last_pg):
- LMDB itself: a page allocated and freed within one transaction is never written
  (mdb_page_flush skips loose pages), so a healthy file may end before that page;
  nothing references it;
- damage: a copy cut short, a disk that filled up, a careless `truncate`; referenced
  pages are then missing.
The two look alike from the outside. So instead of judging, the file is made as long as
its newest transaction says (`extend`, for a writer: zeros past the old end, as LMDB's own
growth leaves them) or read through such a copy (`readable_copy`, for `kvtier inspect`).
Unreferenced pages are then never read, and a referenced page that was lost reads as a
zero page, which LMDB reports as MDB_CORRUPTED: damage becomes an error, not a crash.

The meta page layout (lmdb's mdb.c, 64-bit builds): a 16-byte page header, then mm_magic
and mm_version (two uint32), mm_address and mm_mapsize (8 bytes each), two MDB_db records
of 48 bytes (the free list's md_pad holds the page size), mm_last_pg and mm_txnid (uint64).
Meta pages 0 and 1 alternate; the one with the larger txnid is current.
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

MAGIC = 0xBEEFC0DE
_MAGIC_AT, _PSIZE_AT, _LAST_PG_AT = 16, 40, 136     # offsets in a meta page
_META_BYTES = _LAST_PG_AT + 16


def shortfall(index_dir: Path) -> tuple[int, int] | None:
    """(the file's size, the size its newest transaction uses) of `index_dir`'s data.mdb when
    the file is the shorter, else None (no file; long enough; meta pages lmdb will judge
    itself: an empty file, bad magic)."""
    data = index_dir / "data.mdb"
    try:
        with open(data, "rb") as f:
            head = f.read(2 * 65536 + _META_BYTES)
            # The size after the meta pages: a writer writes a transaction's pages before its
            # meta page, so a meta read first never names pages past a size read after it.
            size = os.fstat(f.fileno()).st_size
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
        return None
    first = meta_of(head, 0)
    if first is None:
        return None
    psize = first[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    metas = [first] + [m for m in (meta_of(head, psize),) if m is not None]
    _, last_pg, _txnid = max(metas, key=lambda m: m[2])
    need = (last_pg + 1) * psize
    return (size, need) if size < need else None


def extend(index_dir: Path) -> tuple[int, int] | None:
    """Make a writable data.mdb as long as its newest transaction uses, before lmdb.open;
    returns (old size, new size) when it grew it."""
    short = shortfall(index_dir)
    if short is not None:
        os.truncate(index_dir / "data.mdb", short[1])
    return short


def readable_copy(index_dir: Path) -> Path | None:
    """None when lmdb can map `index_dir` as it is, else a new temporary directory (the
    caller removes it) holding a copy of its data.mdb made as long as its newest transaction
    uses: a reader that must not write the tier's files opens that instead."""
    short = shortfall(index_dir)
    if short is None:
        return None
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-index-"))
    shutil.copyfile(index_dir / "data.mdb", scratch / "data.mdb")
    os.truncate(scratch / "data.mdb", short[1])
    return scratch


def meta_of(head: bytes, at: int) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of the meta page at byte `at`, or None if it is not one."""
    if len(head) < at + _META_BYTES or struct.unpack_from("<I", head, at + _MAGIC_AT)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", head, at + _PSIZE_AT)[0]
    last_pg, txnid = struct.unpack_from("<QQ", head, at + _LAST_PG_AT)
    return psize, last_pg, txnid
