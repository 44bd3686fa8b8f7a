"""A disk tier's directory, read and sized without opening it: how many blocks it holds
room for, its index read-only (for `kvtier inspect`, beside a live store), whether its
filesystem has room for a tier of some size (the store before it allocates, `kvtier
vllm-check` before vLLM starts), and what a store refuses to take over (a folder of other
files, another program's LMDB).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from kvtier.errors import ConfigError, KvtierError, TierSizeError
from kvtier.tiers.index_checkpoint import readable, rollback_due
from kvtier.tiers.lmdb_check import check_tree, salvage, shortfall, tree_damage
from kvtier.units import format_bytes

ALIGN = 4096                    # O_DIRECT needs offsets, lengths and buffers aligned to this
META = b"meta"                  # the index's database (and record) that describes the tier


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def disk_slot_bytes(block_bytes: int) -> int:
    """A block's slot on disk: rounded up to ALIGN (O_DIRECT)."""
    return _round_up(block_bytes, ALIGN)


def present_blocks(path: str | os.PathLike, block_bytes: int) -> int:
    """How many blocks of `block_bytes` the disk tier in `path` has room for now (0: no tier
    there yet), so a store opened without a capacity keeps the tier's size: the capacity its
    index recorded, else its slab's size. (The slab's size alone made a tier whose slab was
    deleted or cut short come back at the default 16 GiB.)"""
    recorded = _recorded_capacity(Path(path) / "index.lmdb")
    if recorded is not None:
        return recorded
    try:
        size = (Path(path) / "slab.bin").stat().st_size
    except OSError:
        return 0
    return size // disk_slot_bytes(block_bytes)


def _recorded_capacity(where: Path) -> int | None:
    """The capacity in blocks an index recorded at its store's last open; None where there
    is no readable one (the open that follows deals with a damaged or foreign index)."""
    meta = _peek(where)[1]
    n = meta.get("capacity_blocks") if isinstance(meta, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _peek(where: Path) -> tuple[list[bytes], Any]:
    """(the names of an index's databases, its meta record decoded or None), read-only and
    without a lock, before a store opens it; ([], None) where it cannot be read so (no data
    file, one too short to map safely: lmdb_check, one to be rolled back: index_checkpoint,
    damage: the usual open deals with those)."""
    if (not (where / "data.mdb").is_file() or shortfall(where) is not None or rollback_due(where)
            or tree_damage(where, named=False) is not None):
        return [], None
    try:
        env = lmdb.open(str(where), readonly=True, lock=False, max_dbs=4, subdir=True)
    except lmdb.Error:
        return [], None
    try:
        with env.begin() as txn:                 # the main database lists the named ones
            names = [bytes(k) for k, _ in txn.cursor()]
        if META not in names:
            return names, None
        with env.begin(db=env.open_db(META, create=False)) as txn:
            raw = txn.get(b"meta")
        return names, msgpack.unpackb(raw) if raw is not None else None
    except (lmdb.Error, ValueError, msgpack.UnpackException):
        return [], None
    finally:
        env.close()


def salvageable(index_dir: Path) -> tuple[dict[bytes, list[tuple[bytes, bytes]]], list[str]] | None:
    """What a store would rebuild a damaged index from (lmdb_check.salvage: the records, and
    what was wrong with the pages lost); None where its main tree is damaged or its meta
    record is lost or does not decode (the index is set aside whole then)."""
    got = salvage(index_dir)
    if got is None:
        return None
    meta = dict(got[0].get(META, [])).get(b"meta")
    try:
        return got if meta is not None and isinstance(msgpack.unpackb(meta), dict) else None
    except Exception:
        return None


def read_directory(path: str | os.PathLike) -> tuple[dict[str, Any], list[tuple[bytes, list]]]:
    """(meta, [(key, [slot, checksum, created, last access]), ...]) of a disk tier directory,
    read-only and without taking the tier's lock, so it works while a store has it open."""
    path = Path(path)
    if not (path / "index.lmdb").is_dir():
        what = "its index.lmdb is a file, not LMDB's directory" if (path / "index.lmdb").exists() else \
            "no index.lmdb there"
        raise ConfigError(f"{path} holds no kvtier disk tier ({what})")
    copy = readable(path / "index.lmdb")
    try:
        return _read_index(path, copy or path / "index.lmdb")
    finally:
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)


def _read_index(path: Path, index: Path) -> tuple[dict[str, Any], list[tuple[bytes, list]]]:
    """read_directory's reading, from `index` (the tier's, or a readable copy of it)."""
    check_tree(index)                    # before LMDB walks it: a damaged page aborted the process
    try:   # register as a reader, so a running writer does not reuse the pages being read
        env = lmdb.open(str(index), readonly=True, lock=True, max_dbs=4, subdir=True)
    except lmdb.Error:   # no write access to the lock file: read without it (a live writer may race)
        env = lmdb.open(str(index), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        with env.begin() as txn:                 # the main database lists the named ones
            names = [bytes(k) for k, _ in txn.cursor()]
        foreign = [k for k in names if k not in (META, b"blocks")]
        if foreign and META not in names:       # what a store refuses (refuse_foreign)
            raise ConfigError(f"{index} is an LMDB database kvtier did not write (it holds {foreign[0]!r} and "
                              f"{len(foreign) - 1} more keys), not a disk tier: give the disk tier a directory "
                              "of its own")
        meta_db = env.open_db(META, create=False) if META in names else None
        db = env.open_db(b"blocks", create=False) if b"blocks" in names else None
        with env.begin() as txn:
            raw = txn.get(b"meta", db=meta_db) if meta_db is not None else None
            # A record that does not decode is reported as damaged (a store drops it), not
            # as a failure to read the whole index.
            records = [(bytes(k), _unpacked(v)) for k, v in txn.cursor(db=db)] if db is not None else []
    finally:
        env.close()
    if raw is None:
        if records:
            raise ConfigError(f"{path}: the index has block records but no meta record, so what they hold "
                              "cannot be told; it was not written by kvtier, or damaged: move it aside "
                              f"(mv {path / 'index.lmdb'} {path / 'index.lmdb'}.damaged)")
        raise ConfigError(f"{path} holds no kvtier disk tier yet: its index was created but never written "
                          "(a store opened there starts the tier empty)")
    meta = _unpacked(raw)
    if not isinstance(meta, dict):
        raise KvtierError(f"the disk tier index in {path} has a damaged meta record: opening a store on {path} "
                          "moves the index aside (index.lmdb.damaged-TIME) and starts the tier empty")
    return meta, records


def _unpacked(raw: bytes) -> Any:
    """A record decoded, or None if it does not decode (damaged)."""
    try:
        return msgpack.unpackb(raw)
    except Exception:
        return None


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where a mkdir -p of it would start."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def slab_held(path: Path) -> int:
    """Bytes the slab in `path` already has allocated on its filesystem (0: none there)."""
    slab = path / "slab.bin"
    return slab.stat().st_blocks * 512 if slab.is_file() else 0


def unwritable(where: Path) -> str | None:
    """Why files cannot be made in existing directory `where`, or None: it is on a virtual
    filesystem (/proc), a read-only one, or not writable by this user."""
    st = os.statvfs(where)
    if st.f_blocks == 0:              # /proc, /sys: a filesystem with no room for files at all
        return f"{where} is not on a disk (a virtual filesystem such as /proc)"
    if st.f_flag & os.ST_RDONLY:
        return f"{where} is on a read-only filesystem"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{where} is not writable by this user"
    return None


def check_room(path: Path, size: int, held: int | None = None) -> int:
    """Refuse a `size`-byte disk tier at `path` (which may not exist yet) that its filesystem
    has no room for; returns the bytes free there. A slab already there counts with the
    blocks it holds (`held`: so many bytes instead). The tier checks it before it allocates;
    `kvtier vllm-check` before vLLM starts."""
    where = nearest_existing(path)
    need = size - (slab_held(path) if held is None else held)   # bytes not allocated yet
    why = unwritable(where) if need > 0 else None     # (a tier already there may be reopened read-only)
    if why:     # before its free space: a small read-only filesystem is not "too small"
        raise ConfigError(f"cannot create a disk tier in {path}: {why}; give a directory you can write on a disk")
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise TierSizeError(f"not enough free space in {path} for a {format_bytes(size)} disk tier: "
                            f"{format_bytes(free)} is free. Free some space or give the tier less capacity")
    return free


# What a disk tier's directory holds (kvtier writes nothing else there).
_OURS = ("lock", "slab.bin", "index.lmdb")


def refuse_occupied(path: Path) -> None:
    """Refuse a directory holding files that are not a disk tier's, with no tier index in it:
    a store created its slab (16 GiB by default) and index beside them (`--disk /etc` took
    /etc; a folder's own slab.bin was resized and reused)."""
    if (path / "index.lmdb").exists():
        return        # a tier (or what is left of one): the open checks it (foreign LMDB, damage)
    others = sorted(p.name for p in path.iterdir() if not p.name.startswith(_OURS))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(f"disk tier directory {path} already holds files that are not a kvtier disk tier "
                          f"({shown}): give a new or empty directory of its own (kvtier creates it)")


def refuse_foreign(where: Path) -> None:
    """Refuse an index.lmdb another program wrote (no kvtier meta database, keys of its own):
    a store wrote its databases beside the other program's keys."""
    names = _peek(where)[0]
    foreign = [k for k in names if k not in (META, b"blocks")]
    if foreign and META not in names:
        raise ConfigError(f"{where} is an LMDB database kvtier did not write (it holds {foreign[0]!r} and "
                          f"{len(foreign) - 1} more keys): give the disk tier a directory of its own")
