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

import mmap
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterator

import lmdb

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
    found = newest_meta(head)
    if found is None:
        return None
    (psize, last_pg, _txnid), _ = found
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


def newest_meta(head: bytes | mmap.mmap) -> tuple[tuple[int, int, int], int] | None:
    """The newest meta page in the head of a data.mdb: ((page size, last page, txnid), its
    offset), or None where there is none, or its page size is not one LMDB writes."""
    first = meta_of(head, 0)
    if first is None:
        return None
    psize = first[0]
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    metas = [(m, at) for m, at in ((first, 0), (meta_of(head, psize), psize)) if m is not None]
    return max(metas, key=lambda m: m[0][2])


def meta_of(head: bytes | mmap.mmap, at: int) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of the meta page at byte `at`, or None if it is not one."""
    if len(head) < at + _META_BYTES or struct.unpack_from("<I", head, at + _MAGIC_AT)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", head, at + _PSIZE_AT)[0]
    last_pg, txnid = struct.unpack_from("<QQ", head, at + _LAST_PG_AT)
    return psize, last_pg, txnid


# -- the tree's pages, checked before LMDB walks them ------------------------------------
# LMDB trusts a page's type when a cursor steps onto it: a zeroed page (a lost write, a bad
# sector) in an index's tree made it abort the process (`Assertion 'IS_LEAF(mp)' failed`,
# SIGABRT) while a store read the records, at every open and in `kvtier inspect` (16 of 40
# zeroed pages in a session-25 trial). `tree_damage` reads every branch and leaf page of
# the newest snapshot's trees first (headers and branch nodes only: about 5 us a page) and
# names the first that is not what its parent says it is.
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_DBS_AT = 40                       # the meta page's two MDB_db records (free list, main)
_DB = struct.Struct("<IHHQQQQQ")   # md_pad, md_flags, md_depth, branch/leaf/overflow pages, entries, root
_NODE = struct.Struct("<HHHH")     # mn_lo, mn_hi, mn_flags, mn_ksize
_HEADER = struct.Struct("<QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_NO_PAGE = (1 << 64) - 1           # P_INVALID: an empty tree's root


class TreeDamage(lmdb.CorruptedError):
    """A damaged page found by tree_damage, before LMDB read it."""


def check_tree(index_dir: Path) -> None:
    """Raise TreeDamage (an MDB_CORRUPTED: damage) for a page of the index's trees that LMDB
    would abort the process on: before anything opens it with LMDB."""
    damage = tree_damage(index_dir)
    if damage is not None:
        raise TreeDamage(damage)


def tree_damage(index_dir: Path, named: bool = True) -> str | None:
    """What is wrong with the pages of `index_dir`'s newest snapshot (the free list and the
    main tree, and with `named` every database the main tree names), or None. Reads the file
    only: no LMDB call. None too when there is no readable meta page (LMDB judges those).
    A store writing the index meanwhile (inspect reads a live one) may reuse pages of the
    snapshot being walked: damage found while the newest snapshot changed is looked for
    again in the new one."""
    for _ in range(5):
        before = _newest_txnid(index_dir)
        problem = _tree_damage(index_dir, named)
        if problem is None or _newest_txnid(index_dir) == before:
            return problem
    return problem


def _newest_txnid(index_dir: Path) -> int:
    try:
        with open(index_dir / "data.mdb", "rb") as f:
            head = f.read(2 * 65536)
    except OSError:
        return -1
    found = newest_meta(head)
    return found[0][2] if found is not None else -1


def _tree_damage(index_dir: Path, named: bool) -> str | None:
    with _mapped(index_dir) as buf:
        snap = _snapshot(buf)
        if snap is None:
            return None
        psize, pages, free, main = snap
        for _pg, problem in _visit(buf, psize, pages, free, "the free list"):
            if problem:
                return problem
        subs, problem = _databases(buf, psize, pages, main)
        if problem or not named:
            return problem
        for name, db in subs:
            for _pg, problem in _visit(buf, psize, pages, db, f"database {name!r}"):
                if problem:
                    return problem
    return None


def salvage(index_dir: Path) -> tuple[dict[bytes, list[tuple[bytes, bytes]]], list[str]] | None:
    """The records of every named database that can still be read from `index_dir`'s newest
    snapshot ({name: [(key, value), ...]}), and what was wrong with the pages whose records
    are lost; None when the main tree, which names the databases, is itself damaged."""
    with _mapped(index_dir) as buf:
        snap = _snapshot(buf)
        if snap is None:
            return None
        psize, pages, _free, main = snap
        subs, problem = _databases(buf, psize, pages, main)
        if problem:
            return None
        out: dict[bytes, list[tuple[bytes, bytes]]] = {}
        lost: list[str] = []
        for name, db in subs:
            records = out.setdefault(name, [])
            for pg, problem in _visit(buf, psize, pages, db, f"database {name!r}"):
                if problem:
                    lost.append(problem)
                    continue
                for nflags, key, value, problem in _leaf_nodes(buf, psize, pg):
                    if problem or nflags & (_F_BIGDATA | _F_SUBDATA):
                        lost.append(f"database {name!r}: page {pg}: {problem or 'a record kvtier never writes'}")
                    else:
                        records.append((key, value))
        return out, lost


class _mapped:
    """data.mdb mapped read-only (None when there is no file, or an empty one)."""

    def __init__(self, index_dir: Path) -> None:
        self.buf: mmap.mmap | None = None
        try:
            with open(index_dir / "data.mdb", "rb") as f:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            self.buf = None

    def __enter__(self) -> mmap.mmap | None:
        return self.buf

    def __exit__(self, *exc: object) -> None:
        if self.buf is not None:
            self.buf.close()


def _snapshot(buf: mmap.mmap | None) -> tuple[int, int, tuple, tuple] | None:
    """(page size, pages in use, the free list's and the main tree's MDB_db) of the newest
    meta page, or None where there is none to read."""
    found = newest_meta(buf) if buf is not None else None
    if found is None:
        return None                        # (LMDB judges such a header itself)
    (psize, last_pg, _), at = found
    free, main = (_DB.unpack_from(buf, at + _DBS_AT + i * _DB.size) for i in range(2))
    return psize, min(last_pg + 1, len(buf) // psize), free, main


def _databases(buf: mmap.mmap, psize: int, pages: int, main: tuple) -> tuple[list[tuple[bytes, tuple]], str | None]:
    """The named databases the main tree lists ([(name, MDB_db)]), or what is wrong with it."""
    subs = []
    for pg, problem in _visit(buf, psize, pages, main, "the main tree"):
        if problem:
            return subs, problem
        for nflags, key, value, problem in _leaf_nodes(buf, psize, pg):
            if problem:
                return subs, f"the main tree: page {pg}: {problem}"
            if nflags & _F_SUBDATA:
                if len(value) != _DB.size:
                    return subs, f"the main tree: page {pg} holds a damaged record of database {key!r}"
                subs.append((key, _DB.unpack(value)))
    return subs, None


def _visit(buf: mmap.mmap, psize: int, pages: int, db: tuple, what: str) -> Iterator[tuple[int, str | None]]:
    """Each leaf page of the tree of MDB_db `db` as (page, None), and each damaged page as
    (page, what is wrong): its subtree is skipped."""
    root, depth = db[7], db[2]
    if root == _NO_PAGE:
        return
    level = [root]
    for d in range(depth, 0, -1):
        below: list[int] = []
        for pg in level:
            problem = _page_problem(buf, psize, pages, pg, leaf=d == 1)
            if problem is None and d > 1:
                children = []
                for i in range(_count(buf, psize, pg)):
                    at = struct.unpack_from("<H", buf, pg * psize + _HEADER.size + 2 * i)[0]
                    lo, hi, top, ksize = _NODE.unpack_from(buf, pg * psize + at)
                    if at + _NODE.size + ksize > psize:
                        problem = f"page {pg} has a key past its end"
                        break
                    children.append(lo | hi << 16 | top << 32)
                below.extend(children if problem is None else [])
            if problem is not None:
                yield pg, f"{what}: {problem}"
            elif d == 1:
                yield pg, None
        level = below


def _page_problem(buf: mmap.mmap, psize: int, pages: int, pg: int, leaf: bool) -> str | None:
    if pg < 2 or pg >= pages:
        return f"page {pg} is past the file's {pages} pages"
    pgno, _pad, flags, lower, upper = _HEADER.unpack_from(buf, pg * psize)
    if pgno != pg or not flags & (_P_LEAF if leaf else _P_BRANCH) or flags & _P_LEAF2:
        return (f"page {pg} is not the {'leaf' if leaf else 'branch'} page its parent names "
                f"(it reads as page {pgno}, flags {flags:#x})")
    if not _HEADER.size <= lower <= upper <= psize or (lower - _HEADER.size) % 2:
        return f"page {pg} has a damaged header (lower {lower}, upper {upper})"
    for i in range(_count(buf, psize, pg)):
        at = struct.unpack_from("<H", buf, pg * psize + _HEADER.size + 2 * i)[0]
        if not upper <= at <= psize - _NODE.size:
            return f"page {pg} has a node outside it (at {at})"
    return None


def _count(buf: mmap.mmap, psize: int, pg: int) -> int:
    return (struct.unpack_from("<H", buf, pg * psize + 12)[0] - _HEADER.size) // 2


def _leaf_nodes(buf: mmap.mmap, psize: int, pg: int) -> Iterator[tuple[int, bytes, bytes, str | None]]:
    """(flags, key, value, None) of each record of a checked leaf page; (0, b"", b"", what is
    wrong) for one that does not fit in it."""
    base = pg * psize
    for i in range(_count(buf, psize, pg)):
        at = struct.unpack_from("<H", buf, base + _HEADER.size + 2 * i)[0]
        lo, hi, nflags, ksize = _NODE.unpack_from(buf, base + at)
        size = 8 if nflags & _F_BIGDATA else lo | hi << 16      # (BIGDATA: an overflow page number)
        k = base + at + _NODE.size
        if at + _NODE.size + ksize + size > psize:
            yield 0, b"", b"", "a record past the page's end"
            continue
        yield nflags, bytes(buf[k:k + ksize]), bytes(buf[k + ksize:k + ksize + size]), None
