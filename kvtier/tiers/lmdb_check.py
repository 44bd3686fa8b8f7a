"""Is an LMDB file whole enough to open? Checked before lmdb.open, which cannot say so itself.

LMDB maps its data file into memory. A file cut shorter than the pages its newest meta
page says are in use (a copy interrupted, a disk that filled up, a careless `truncate`)
opens without complaint, and the first read of a missing page is a SIGBUS that kills the
process with no message. So the disk tier and `kvtier inspect` read the two meta pages
first and treat such a file as a damaged index.

The meta page layout (lmdb's mdb.c, 64-bit builds): a 16-byte page header, then mm_magic
and mm_version (two uint32), mm_address and mm_mapsize (8 bytes each), two MDB_db records
of 48 bytes (the free list's md_pad holds the page size), mm_last_pg and mm_txnid (uint64).
Meta pages 0 and 1 alternate; the one with the larger txnid is current.
"""
from __future__ import annotations

import struct
from pathlib import Path

MAGIC = 0xBEEFC0DE
_MAGIC_AT, _PSIZE_AT, _LAST_PG_AT = 16, 40, 136     # offsets in a meta page
_META_BYTES = _LAST_PG_AT + 16


def truncation(index_dir: Path) -> str | None:
    """Why `index_dir`'s data.mdb is shorter than its newest transaction needs, or None (no
    file, or one whose meta pages lmdb will judge itself: an empty file, bad magic)."""
    data = index_dir / "data.mdb"
    try:
        with open(data, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(2 * 65536 + _META_BYTES)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
        return None
    metas = []
    first = _meta(head, 0)
    if first is None:
        return None
    psize = first[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    metas.append(first)
    second = _meta(head, psize)
    if second is not None:
        metas.append(second)
    _, last_pg, txnid = max(metas, key=lambda m: m[2])
    need = (last_pg + 1) * psize
    if size < need:
        return f"{data.name} is {size} bytes but its transaction {txnid} uses {need} (the file was cut short)"
    return None


def _meta(head: bytes, at: int) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of the meta page at byte `at`, or None if it is not one."""
    if len(head) < at + _META_BYTES or struct.unpack_from("<I", head, at + _MAGIC_AT)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", head, at + _PSIZE_AT)[0]
    last_pg, txnid = struct.unpack_from("<QQ", head, at + _LAST_PG_AT)
    return psize, last_pg, txnid
