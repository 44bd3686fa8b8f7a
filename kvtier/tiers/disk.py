"""NVMe tier: a preallocated slab file cut into 4 KiB-aligned slots, with an LMDB index.

    PATH/slab.bin     capacity x slot_bytes, written and read with O_DIRECT
    PATH/index.lmdb   meta (layout, namespace, sizes) and one record per block:
                      key -> [slot, xxh3-64 checksum, created, last access]
    PATH/lock         flock (and PATH itself): one process at a time

Crash safety: a block's record is committed only after its bytes are written, and every
read is verified against the record's checksum, so a torn write, a slot reused before a
deletion was committed, a flipped byte or a truncated file reads as a miss, never as
wrong KV. Records are committed per write batch without fsync (a killed process loses
nothing committed); flush() makes everything durable against power loss too, and so does a
checkpoint started a few seconds or commits after any write (kvtier.tiers.index_checkpoint:
a power loss costs the commits after the last one, never the index).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Sequence

import lmdb
import msgpack
import numpy as np

from kvtier.checksum import block_checksum, block_checksums
from kvtier.config import MAX_DISK_IO_THREADS
from kvtier.errors import (ClosedError, ConfigError, KvtierError, TierInUseError, TierSizeError, TransferError,
                           WriteInterrupted)
from kvtier.ids import BlockKey, SlotId
from kvtier.submit import submit
from kvtier.tiers import index_checkpoint
from kvtier.tiers.base import Demand, PendingWrite, Tier
from kvtier.tiers.disk_dir import (ALIGN, META, check_room, disk_slot_bytes, nearest_existing, present_blocks,
                                   refuse_foreign, refuse_occupied, salvageable, slab_held)
from kvtier.tiers.lmdb_check import TreeDamage, check_tree, extend, tree_damage

log = logging.getLogger("kvtier.disk")

_CORRUPT = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError, lmdb.VersionMismatchError)


class _DamagedMeta(Exception):
    """The tier's meta record is not what kvtier writes (undecodable, not a map)."""


# Damage found while reading the index at open, past its header pages: a damaged page
# (LMDB reports MDB_CORRUPTED, then refuses the rest of the transaction: MDB_BAD_TXN), or a
# meta record that does not decode. The index is set aside, as a damaged header is.
_DAMAGE = _CORRUPT + (lmdb.BadTxnError, _DamagedMeta)
DISK_FORMAT = 1
STAGING_BYTES = 8 << 20         # per I/O thread: bytes moved per syscall at most
MAX_IOV = 512                   # buffers per preadv/pwritev (the kernel allows 1024)
MAX_IO_THREADS = MAX_DISK_IO_THREADS   # a bound on a setting that costs STAGING_BYTES of memory each


def _aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGN == 0


class DiskTier(Tier):
    """Blocks on local disk, surviving restarts. `DiskTier("/nvme/kv", capacity="200GiB")`."""

    kind = "disk"
    persistent = True
    keeps_size = True        # DiskTier(path) reopens the tier there at the size it had

    def __init__(self, path: str | os.PathLike, capacity: int | str | None = None, *,
                 blocks: int | None = None, name: str | None = None, direct: bool | None = None,
                 io_threads: int = 4, read_only: bool = False) -> None:
        super().__init__(capacity, blocks=blocks, name=name)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= MAX_IO_THREADS:
            raise ConfigError(f"io_threads must be a whole number from 1 to {MAX_IO_THREADS} (each holds an "
                              f"{STAGING_BYTES >> 20} MiB buffer), got {io_threads!r}")
        if not isinstance(path, (str, os.PathLike)) or not str(path) or "\0" in str(path):
            raise ConfigError(f"a disk tier needs a directory path, got {path!r}")
        if direct not in (None, True, False):
            raise ConfigError(f"direct must be None (O_DIRECT where the filesystem allows it), True or False, "
                              f"got {direct!r}")
        self.path = Path(path)
        self.want_direct = direct
        self.io_threads = io_threads
        self.read_only = read_only
        self.direct = False
        self.io_note = ""
        self.slot_bytes = 0
        self.identity: dict[str, Any] = {}
        self._records: dict[int, tuple[bytes, int]] = {}   # slot -> (key, checksum)
        self._access: dict[int, float] = {}                # slot -> last access
        self._touched: set[int] = set()                    # slots read since the last flush
        self._deleted: list[bytes] = []                    # keys whose records go at the next commit
        # One lock for the record maps and LMDB write transactions: the store calls write()
        # and read() outside its own lock (copies), release() inside it, flush() from anywhere.
        self._meta_lock = threading.Lock()
        self._fd = -1
        self._lock_fds: list[int] = []     # flocked: the directory and its `lock` file
        self._kept: int | None = None      # the slots of the tier found in `path` (given no size)
        self._env: lmdb.Environment | None = None
        self._scratch: str | None = None       # read-only: where a short index was copied to be read
        self._db = None
        self._checkpoints: index_checkpoint.Checkpointer | None = None   # (writable, once open)
        self._pool: ThreadPoolExecutor | None = None
        self._staging: list[mmap.mmap] = []
        self._busy = 0            # runs on the I/O threads now (begin_write waits for idle ones to start)
        self._busy_lock = threading.Lock()
        self.corrupt = 0          # blocks that failed verification (stats)

    # -- opening -------------------------------------------------------------------
    def bind(self, block_bytes: int, identity: dict[str, Any] | None = None) -> int:
        self.identity = dict(identity or {})
        return super().bind(block_bytes)

    def _kept_slots(self, block_bytes: int) -> int:
        # Read once: the store asks for the size ahead (demand) and again when it binds.
        if self._kept is None:
            self._kept = present_blocks(self.path, block_bytes)
        n = self._kept
        if n == 0:
            raise ConfigError(f"disk tier {self.path}: no tier there to reopen at its size: give a new one a "
                              "capacity (bytes, e.g. capacity='64GiB') or blocks=N")
        return n

    def demand(self, block_bytes: int) -> Demand | None:
        if self.read_only or (self.path.exists() and not self.path.is_dir()):
            return None                    # (opening it says what is wrong)
        path = self.path

        def room(_what: str, need: int) -> TierSizeError | None:
            try:
                check_room(path, need, held=0)
            except TierSizeError as e:
                return e
            return None

        try:                               # tiers on one filesystem share its free space
            where = f"disk space on device {os.stat(nearest_existing(path)).st_dev}"
        except OSError:
            where = f"disk space in {path}"
        size = self.slots_for(block_bytes) * self.slot_size(block_bytes)
        return Demand(where, max(0, size - slab_held(path)), room, f"disk space in {path}")

    def slot_size(self, block_bytes: int) -> int:
        """A block's slot on disk is rounded up to ALIGN (O_DIRECT): the slab never exceeds the
        capacity (it took twice the capacity with 2 KiB blocks)."""
        return disk_slot_bytes(block_bytes)

    def _allocate(self, slots: int, block_bytes: int) -> None:
        self.slot_bytes = self.slot_size(block_bytes)
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"disk tier path {self.path} is a file, not a directory: give a directory "
                              "(it is created if missing)")
        if self.read_only and not (self.path / "index.lmdb").is_dir():
            raise ConfigError(f"{self.path} holds no kvtier disk tier (no index.lmdb there)")
        if not self.read_only:
            self._check_room(slots * self.slot_bytes)   # before anything is created
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create disk tier directory {self.path}: {e.strerror}") from None
        if not self.path.is_dir():
            raise ConfigError(f"disk tier path {self.path} exists and is not a directory")
        if not self.read_only:
            refuse_occupied(self.path)
        try:
            self._take_lock()
            self._open_index()
            try:
                self._open_dbs()
                self._check_meta(slots, block_bytes)
                self._open_slab(slots)
                self._load_records(slots)
            except _DAMAGE as e:      # a damaged page found only while reading: the header was whole
                if self.read_only:
                    raise ConfigError(f"the disk tier index in {self.path} is damaged: {e}") from None
                self._records.clear()
                self._access.clear()
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1
                where = self.path / "index.lmdb"
                self._close_env()
                if self._rebuild(where, str(e)):
                    self._open_env(where)
                else:
                    self._set_aside(where, e)
                self._open_dbs()
                self._check_meta(slots, block_bytes)
                self._open_slab(slots)
                self._load_records(slots)
            if self._checkpoints is not None:
                self._checkpoints.now()   # the open's own writes
            chunk = max(self.slot_bytes, STAGING_BYTES // self.slot_bytes * self.slot_bytes)
            self._staging = [mmap.mmap(-1, chunk) for _ in range(self.io_threads)]
        except lmdb.Error as e:       # writing the index at open: a full disk, an I/O error
            self._release_handles()
            raise self._index_error(e, "open", TierSizeError if _full(e) else ConfigError) from None
        except OSError as e:          # no permission, a read-only or immutable folder, a full disk
            self._release_handles()
            where = f" ({e.filename})" if e.filename else ""
            hint = ("give a directory this user can write (`kvtier inspect` reads one it cannot)"
                    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else
                    "check the disk and the directory, or give another one")
            raise ConfigError(f"cannot open disk tier {self.path}: {e.strerror or e}{where}: {hint}") from None
        except BaseException:
            self._release_handles()   # a failed open leaves no lock or handle behind
            raise
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvtier-{self.name}")
        self._chunk_slots = min(MAX_IOV, chunk // self.slot_bytes)
        self._free_staging = list(range(self.io_threads))

    def _take_lock(self) -> None:
        if self.read_only:
            return
        # The directory itself is locked, and the `lock` file in it (what earlier versions
        # lock): a `lock` file deleted under a live store let a second one open the tier
        # (each then dropped the other's records as damaged: 119 of 120 acknowledged
        # requests lost), and a directory cannot be unlinked while it holds the tier's files.
        try:
            for where, flags in ((self.path, os.O_RDONLY | os.O_DIRECTORY),
                                 (self.path / "lock", os.O_RDWR | os.O_CREAT)):
                fd = os.open(where, flags, 0o644)
                self._lock_fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise
                except OSError as e:
                    if where != self.path:
                        raise
                    # NFS emulates flock with a write lock, which a directory opened to read
                    # cannot take (some FUSE and CIFS mounts refuse it too): the lock file alone
                    log.info("disk tier %s: cannot lock the directory itself (%s); locking its lock file only",
                             self.path, e.strerror or e)
                    os.close(self._lock_fds.pop())
        except BlockingIOError:
            self._drop_locks()
            raise TierInUseError(f"disk tier {self.path} is in use by another store (in this process or "
                              f"another); give each store its own directory (`kvtier inspect {self.path}` reads it while in use)") from None

    def _drop_locks(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)               # closing the descriptor drops its flock
        self._lock_fds = []

    def _open_index(self) -> None:
        where = self.path / "index.lmdb"
        short = where.with_name("index.lmdb.short")
        if not self.read_only and not where.exists() and short.is_dir():
            short.rename(where)            # killed inside _compact's two renames: the old index is whole
        try:
            # A data.mdb shorter than its newest transaction (LMDB leaves pages freed in the
            # transaction that took them unwritten; or the file was cut) would be mapped and
            # kill the process with SIGBUS on a read past its end (kvtier.tiers.lmdb_check).
            if self.read_only:
                copy = index_checkpoint.readable(where)
                self._scratch = str(copy) if copy is not None else None
                check_tree(copy or where)
                self._env = lmdb.open(str(copy or where), map_size=1 << 36, max_dbs=4, subdir=True, readonly=True,
                                      lock=False)
            else:
                data = where / "data.mdb"
                if data.is_file() and data.stat().st_size == 0:
                    # LMDB takes an empty file for a new index: the tier started empty without
                    # a word, every block in the slab unreachable
                    self._set_aside(where, "its data.mdb is empty (0 bytes)")
                    return
                rolled = index_checkpoint.roll_back(where)   # before anything reads the snapshot
                if rolled is not None:
                    log.warning("disk tier %s: the machine restarted since this index was last synced: its %d "
                                "commits after that may be only partly on disk; rolled back to the synced one "
                                "(blocks written since may be missing)", self.path, rolled[0] - rolled[1])
                refuse_foreign(where)      # before anything of ours touches it (extend, compact)
                grown = extend(where)
                self._salvage_damaged(where)   # before LMDB walks it: a damaged page aborted the process
                self._open_env(where)
                if grown is not None:
                    self._compact(where, grown)
        except _CORRUPT as e:
            self._close_env()
            shutil.rmtree(where.with_name("index.lmdb.compact"), ignore_errors=True)
            if self.read_only:
                raise ConfigError(f"the disk tier index in {self.path} is damaged: {e}") from None
            if (where / "data.mdb").is_file() and self._rebuild(where, str(e)):
                self._open_env(where)
            else:
                self._set_aside(where, e)
        except lmdb.Error as e:
            raise self._index_error(e, "open", TierSizeError if _full(e) else ConfigError) from None

    def _open_env(self, where: Path) -> None:
        """Open the writable index `where` and take its checkpoint before anything writes to
        it: the one an earlier process saved is not held here, and the open's own writes
        (dropped records, the meta record) reused its pages (a power loss then rolled back
        onto them: the store refused the index as another program's)."""
        self._env = lmdb.open(str(where), map_size=1 << 36, max_dbs=4, subdir=True, sync=False, metasync=False)
        self._checkpoints = index_checkpoint.Checkpointer(self._env, where, lambda: self._fd, self._meta_lock)
        self._checkpoints.now()

    def _close_env(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()     # (waits for one under way, lets go of its snapshot)
            self._checkpoints = None
        if self._env is not None:
            self._env.close()
            self._env = None

    def _open_dbs(self) -> None:
        assert self._env is not None
        self._meta_db = self._env.open_db(META, create=not self.read_only)
        self._db = self._env.open_db(b"blocks", create=not self.read_only)

    def _set_aside(self, where: Path, e: Exception | str) -> None:
        """A cache may forget: move the damaged index aside and start an empty one (the
        slab's bytes are never trusted without a record and its checksum)."""
        self._close_env()
        aside = _aside(where)
        log.warning("disk tier %s: index damaged (%s); moved to %s, starting empty", self.path, e, aside.name)
        where.rename(aside)
        self._open_env(where)

    def _salvage_damaged(self, where: Path) -> None:
        """A damaged page in the index's trees (lmdb_check.tree_damage), found before LMDB
        reads it: rebuilt (_rebuild), or raised as MDB_CORRUPTED (set aside: the tier starts
        empty) where the main tree or the meta record is what is damaged."""
        damage = tree_damage(where)
        if damage is not None and not self._rebuild(where, damage):
            raise TreeDamage(damage)

    def _rebuild(self, where: Path, damage: str) -> bool:
        """Rewrite the damaged index `where` (closed) from the records of its readable pages
        (lmdb_check.salvage), keeping the damaged one aside; False where it cannot be (its
        main tree or meta record lost)."""
        got = salvageable(where)
        if got is None:
            return False
        records, lost = got
        fresh = self._write_fresh(where, {name: records.get(name, []) for name in (META, b"blocks")})
        aside = _aside(where)
        self._swap_in(where, fresh, keep_old=aside, reopen=False)
        log.warning("disk tier %s: index damaged (%s); rebuilt from its readable pages: kept %d records, lost "
                    "those of %d damaged pages; the damaged index is in %s", self.path, damage,
                    len(records.get(b"blocks", [])), len(lost), aside.name)
        return True

    def _index_error(self, e: lmdb.Error, doing: str, kind: type[KvtierError] = TransferError) -> KvtierError:
        """An LMDB failure as a kvtier error that says what to do (LMDB's own text names only
        the call that failed: `mdb_txn_commit: No space left on device`)."""
        if _full(e):
            what = (f"the filesystem holding it is full: its index cannot grow ({e}); free some space "
                    "there (the slab is preallocated: only index.lmdb grows)")
        elif isinstance(e, lmdb.MapFullError):
            what = f"its index reached LMDB's map size ({e}): give the tier less capacity or larger blocks"
        elif isinstance(e, _DAMAGE):
            what = (f"its index is damaged ({e}): restart the store (it moves a damaged index aside and "
                    "starts the tier empty)")
        else:
            what = f"its index failed ({type(e).__name__}: {e}): check the disk (dmesg) and the directory"
        return kind(f"disk tier {self.path}: cannot {doing}: {what}")

    def _compact(self, where: Path, grown: tuple[int, int]) -> None:
        """Rewrite an index that was shorter than its newest transaction as a compact copy
        (every referenced page read, none past the end, the free list rebuilt): a page lost
        from it raises MDB_CORRUPTED here (the index is damaged), not on some later write."""
        fresh = where.with_name("index.lmdb.compact")
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        assert self._env is not None
        self._env.copy(str(fresh), compact=True)
        self._swap_in(where, fresh)
        log.info("disk tier %s: index was %d bytes, its newest transaction uses %d; rewritten compact",
                 self.path, *grown)

    def _swap_in(self, where: Path, fresh: Path, keep_old: Path | None = None, reopen: bool = True) -> None:
        """Put the index rewritten in `fresh` in the place of `where` (the old one removed, or
        moved to `keep_old`) and open it (killed between the two renames: _open_index takes
        the old one back, whole)."""
        self._close_env()
        fd = os.open(fresh / "data.mdb", os.O_RDONLY)   # (LMDB's copy writes with O_DIRECT, unsynced)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        old = where.with_name("index.lmdb.short")
        shutil.rmtree(old, ignore_errors=True)
        where.rename(old)
        fresh.rename(where)
        index_checkpoint.sync_dir(self.path)   # the new one in place (power loss too) before the old one goes
        if keep_old is not None:
            old.rename(keep_old)
        else:
            shutil.rmtree(old, ignore_errors=True)
        if reopen:
            self._open_env(where)

    def _write_fresh(self, where: Path, records: dict[bytes, Any]) -> Path:
        """A new index beside `where` (index.lmdb.compact) holding `records` ({database: an
        iterable of (key, value) pairs}), synced."""
        fresh = where.with_name("index.lmdb.compact")
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        new = lmdb.open(str(fresh), map_size=1 << 36, max_dbs=4, subdir=True, sync=False, metasync=False)
        try:
            with new.begin(write=True) as txn:
                for name, pairs in records.items():
                    txn.cursor(db=new.open_db(name, txn=txn)).putmulti(pairs)
            new.sync(True)
        finally:
            new.close()
        return fresh

    def _rewrite_without(self, drop: set[bytes]) -> None:
        """Rewrite the index without the records `drop` (damaged among them), record by
        record: deleting a damaged record in place let LMDB trust its damaged size, and the
        page it sat in was corrupted for good (every later open died with SIGBUS)."""
        where = self.path / "index.lmdb"
        with self._env.begin() as old:
            fresh = self._write_fresh(where, {
                META: ((bytes(k), bytes(v)) for k, v in old.cursor(db=self._meta_db)),   # (streamed)
                b"blocks": ((bytes(k), bytes(v)) for k, v in old.cursor(db=self._db) if bytes(k) not in drop)})
        self._swap_in(where, fresh)
        self._open_dbs()

    def _check_meta(self, slots: int, block_bytes: int) -> None:
        with self._env.begin(db=self._meta_db) as txn:
            raw = txn.get(b"meta")
        want = {"format": DISK_FORMAT, "block_bytes": block_bytes, "slot_bytes": self.slot_bytes,
                **self.identity}
        if raw is None:
            if self.read_only:
                raise ConfigError(f"{self.path} holds no kvtier disk tier")
            with self._env.begin(db=self._meta_db, write=True) as txn:
                txn.put(b"meta", msgpack.packb({**want, "capacity_blocks": slots, "created": time.time()}))
            return
        try:
            have = msgpack.unpackb(raw)
        except Exception as e:
            raise _DamagedMeta(f"its meta record does not decode: {type(e).__name__}: {e}") from None
        if not isinstance(have, dict):
            raise _DamagedMeta(f"its meta record is a {type(have).__name__}, not a map")
        for field in (*self.identity, "format", "block_bytes", "slot_bytes"):
            if have.get(field) != want.get(field):
                if field == "namespace_seed" and have.get("namespace") == want.get("namespace"):
                    what = "under another tenant salt, key hash or layout"
                elif field in ("namespace", "namespace_seed"):
                    what = (f"by model {have.get('namespace', {}).get('model')!r} revision "
                            f"{have.get('namespace', {}).get('revision')!r}; this store is model "
                            f"{want.get('namespace', {}).get('model')!r} revision {want.get('namespace', {}).get('revision')!r}")
                elif field == "layout" and isinstance(have.get(field), dict) and isinstance(want.get(field), dict):
                    diff = [f"{k} {have[field].get(k)!r}, this store's {want[field].get(k)!r}"
                            for k in sorted(set(have[field]) | set(want[field]))
                            if have[field].get(k) != want[field].get(k)]
                    what = f"with another layout ({'; '.join(diff)})"
                else:
                    what = f"with another {field} ({have.get(field)!r}, this store has {want.get(field)!r})"
                raise ConfigError(
                    f"disk tier {self.path} was written {what}: its blocks cannot be used here. Use another "
                    "folder for this store (`kvtier inspect PATH` shows what this one holds)")
        if not self.read_only and have.get("capacity_blocks") != slots:
            with self._env.begin(db=self._meta_db, write=True) as txn:
                txn.put(b"meta", msgpack.packb({**have, "capacity_blocks": slots}))

    def _open_slab(self, slots: int) -> None:
        slab = self.path / "slab.bin"
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        want_direct = self.want_direct is not False
        fd = -1
        if want_direct:
            try:
                fd = os.open(slab, flags | os.O_DIRECT, 0o644)
                self.direct, self.io_note = True, "O_DIRECT"
            except OSError as e:
                if self.want_direct:
                    raise ConfigError(f"O_DIRECT refused for {slab}: {e.strerror}; use direct=None or False") from None
                self.io_note = f"buffered: O_DIRECT refused ({e.strerror})"
        if fd < 0:
            fd = os.open(slab, flags, 0o644)
            self.io_note = self.io_note or "buffered (direct=False)"
        self._fd = fd
        self._found_bytes = os.fstat(fd).st_size   # before resizing: records past it are lost
        size = slots * self.slot_bytes
        if self.read_only:
            return
        try:
            if os.fstat(fd).st_size < size:
                self._check_room(size)          # again: the disk may have filled since
                os.posix_fallocate(fd, 0, size)
            elif os.fstat(fd).st_size > size:
                self._move_below(slots)
                os.ftruncate(fd, size)
        except OSError as e:
            try:    # a refused allocation may have taken part of the space: give it back
                if os.fstat(fd).st_size > self._found_bytes:
                    os.ftruncate(fd, self._found_bytes)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                why = "not enough free space" if e.errno == errno.ENOSPC else "a file too large for the filesystem"
                raise TierSizeError(f"{why} in {self.path} for {size} bytes of disk tier: "
                                    "free some space or give the tier less capacity") from None
            raise ConfigError(f"cannot size the slab file {slab}: {e.strerror}") from None

    def _move_below(self, slots: int) -> None:
        """Before the slab shrinks to `slots`: keep the `slots` most recently used blocks
        (_recency), wherever they are: the others' records go first (synced), then the kept
        blocks past the new end move into the freed and free slots below it (bytes, synced,
        then their records), then the caller cuts the file. A crash part way leaves every
        record pointing at whole bytes; the rest is dropped by _load_records."""
        sb = self.slot_bytes
        recs = []
        with self._env.begin(db=self._db) as txn:
            for key, raw in txn.cursor():
                try:
                    slot, checksum, created, last = msgpack.unpackb(raw)
                except Exception:      # a damaged record: _load_records drops it
                    continue
                if (isinstance(slot, int) and 0 <= slot and (slot + 1) * sb <= self._found_bytes
                        and isinstance(last, (int, float))):
                    recs.append((bytes(key), slot, checksum, created, last))
        if not any(r[1] >= slots for r in recs):
            return
        keep = sorted(recs, key=lambda r: _recency(r[4], r[1]), reverse=True)[:slots]
        kept = {r[0] for r in keep}
        dropped = [r[0] for r in recs if r[0] not in kept]
        past = [r for r in keep if r[1] >= slots]
        used = {r[1] for r in keep if r[1] < slots}
        free = (s for s in range(slots) if s not in used)
        moves = list(zip(past, free))
        if dropped:                    # their slots may take kept blocks: no record may point there first
            with self._env.begin(db=self._db, write=True) as txn:
                for key in dropped:
                    txn.delete(key)
            self._env.sync(True)
        if not moves:
            return
        log.info("disk tier %s: shrinking to %d slots: moving %d blocks below the new end", self.path, slots,
                 len(moves))
        buf = mmap.mmap(-1, sb)        # page-aligned, as O_DIRECT needs
        moved = []
        try:
            for rec, dst in moves:
                if _preadv_all(self._fd, [buf], rec[1] * sb) == sb:
                    _pwritev_all(self._fd, [buf], dst * sb)
                    moved.append((rec, dst))
            os.fsync(self._fd)
        finally:
            buf.close()
        with self._env.begin(db=self._db, write=True) as txn:
            for (key, _slot, checksum, created, last), dst in moved:
                txn.put(key, msgpack.packb([dst, checksum, created, last]))
        self._env.sync(True)           # the records on disk before the file is cut (power loss too)
        log.info("disk tier %s: shrunk to %d slots; moved %d blocks below the new end, dropped %d less "
                 "recently used", self.path, slots, len(moved), len(recs) - len(keep) + len(past) - len(moved))

    def _check_room(self, size: int) -> None:
        """Refuse a slab of `size` bytes the filesystem has no room for, before allocating any
        of it (a posix_fallocate that runs out of space part way has filled the disk
        meanwhile) and before creating the tier's directory or files (a refused tier leaves
        nothing behind)."""
        check_room(self.path, size)

    def _load_records(self, slots: int) -> None:
        """Read every record; drop those the slab can no longer hold (shrunk or truncated)."""
        size = min(self._found_bytes, os.fstat(self._fd).st_size)
        stale = []
        damaged = 0
        with self._env.begin(db=self._db) as txn:
            for key, raw in txn.cursor():
                try:
                    slot, checksum, _created, last = msgpack.unpackb(raw)
                    valid = (len(key) == 16 and isinstance(slot, int) and slot >= 0 and isinstance(checksum, int)
                             and isinstance(last, (int, float)))
                except Exception:   # a damaged record: forget it, like one past the slab
                    valid = False
                if not valid or slot in self._records:
                    damaged += 1
                    stale.append(key)
                    continue
                if slot >= slots or (slot + 1) * self.slot_bytes > size:
                    stale.append(key)
                    continue
                self._records[slot] = (bytes(key), checksum)
                self._access[slot] = last
        if stale and not self.read_only:
            past = len(stale) - damaged
            log.warning("disk tier %s: dropped %s", self.path, " and ".join(
                [f"{past} records that point past the slab (resized or truncated)"] * bool(past)
                + [f"{damaged} damaged records (undecodable, or a second record for one slot)"]
                * bool(damaged)))
            if damaged:
                self._rewrite_without({bytes(k) for k in stale})
            else:
                with self._env.begin(db=self._db, write=True) as txn:
                    for k in stale:
                        txn.delete(k)

    def recover(self) -> list[tuple[BlockKey, SlotId]]:
        """(key, slot) of every block the directory holds, least recently used first."""
        # The order of _recency, sorted by numpy: a sort keyed by a Python function took 6.5 s
        # of a restart with 2M blocks (3 s here).
        slots = np.fromiter(self._records, dtype=np.int64, count=len(self._records))
        access = np.fromiter((self._access.get(s, 0.0) for s in slots.tolist()), dtype=np.float64, count=len(slots))
        order = slots[np.lexsort((-slots, access))].tolist()
        records = self._records
        return [(records[s][0], s) for s in order]

    # -- moving bytes ----------------------------------------------------------------
    def write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray], idx: Sequence[int] | None = None,
              keys: Sequence[BlockKey] | None = None) -> None:
        """Write rows (idx picks them) into slots as the blocks `keys`, checksummed and
        recorded: readable (and verifiable) once this returns."""
        self._start_write(slots, rows, idx, keys, until_started=False).wait()

    def begin_write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray], idx: Sequence[int] | None = None,
                    keys: Sequence[BlockKey] | None = None, *, executor: Executor | None = None) -> PendingWrite:
        """Start the writes on the I/O threads and return once the first are in the kernel;
        wait() checksums the blocks on the calling thread while the bytes go to disk, then
        commits their records. (`executor` is not used: the tier has threads of its own.)"""
        return self._start_write(slots, rows, idx, keys, until_started=True)

    def _start_write(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray], idx: Sequence[int] | None,
                     keys: Sequence[BlockKey] | None, until_started: bool) -> PendingWrite:
        if keys is None:
            raise ConfigError("the disk tier needs the blocks' keys to write them")
        if self.read_only:
            raise ConfigError(f"disk tier {self.path} was opened read-only")
        order = list(range(len(slots))) if idx is None else list(idx)
        # Speed (until_started): begin_write returns only once the I/O threads hold their
        # first runs. A thread woken by submit() waits for the GIL, and a caller that went
        # on with Python work (a put reserving its remaining slots: about 1.5 ms for 512
        # blocks) kept the disk idle until it was done.
        pending = self._parallel(self._write_run, slots, rows, order, until_started)
        return PendingWrite(lambda: self._finish_write(pending, slots, rows, order, keys))

    def _finish_write(self, pending: list[Future], slots: Sequence[SlotId], rows: Sequence[np.ndarray],
                      order: list[int], keys: Sequence[BlockKey]) -> None:
        # Speed: the bytes go to disk on the I/O threads while this thread computes the
        # checksums (with the GIL released: kvtier.checksum) and packs the records, so only
        # the index's commit follows the last write. All blocks in one C call (one release of
        # the GIL, not one per block, which the I/O threads waited on): 512 x 1 MiB, 30 rounds
        # alternated in one process, 0.894 -> 0.912 of raw O_DIRECT (0.980 with no checksum).
        # Hashing each run on its I/O thread before its write measured 0.80-0.85; hashing run
        # k as run k starts or once it ended, 0.87-0.92: this VM's disk slows with any memory
        # read beside it, however it is spread (docs/benchmarks.md#disk-tier).
        interrupt: BaseException | None = None
        sums: list[int] | None = None
        try:
            sums = block_checksums([rows[i] for i in order])
        except Exception:
            wait_quietly(pending)
            raise
        except BaseException as e:             # a Ctrl-C: the writes are finished and recorded first
            interrupt = e
        errors = []
        for f in pending:                      # every write is finished before any error is raised:
            while True:                        # the store may reuse these slots right after
                try:
                    f.result()
                except Exception as e:
                    errors.append(e)
                except BaseException as e:
                    if f.done() and not f.cancelled() and f.exception() is e:
                        errors.append(e)       # the run's own (never a KeyboardInterrupt: not its thread)
                    else:                      # a Ctrl-C while waiting: go on waiting
                        interrupt = interrupt or e
                        continue
                break
        if interrupt is not None and (errors or not isinstance(interrupt, KeyboardInterrupt)):
            raise interrupt                    # nothing recorded: the caller undoes the write
        if errors:
            raise TransferError(f"disk tier {self.path}: write failed: {errors[0]}") from errors[0]
        if sums is None:
            sums = block_checksums([rows[i] for i in order])
        now = time.time()
        pack = msgpack.Packer().pack
        puts = [(k, pack([s, c, now, now])) for s, k, c in zip(slots, keys, sums)]
        with self._meta_lock:
            deletes = list(self._deleted)
            for s, k in zip(slots, keys):
                old = self._records.get(s)
                if old is not None and old[0] != k:
                    deletes.append(old[0])
            self._commit(puts, deletes)
            for s, k, c in zip(slots, keys, sums):   # memory follows only a committed index
                self._records[s] = (k, c)
                self._access[s] = now
        if self._checkpoints.due():
            try:
                self._checkpoints.soon()
            except KeyboardInterrupt as e:      # the write is recorded: raised as one below
                interrupt = interrupt or e
        if interrupt is not None:
            raise WriteInterrupted(f"interrupted while writing {len(slots)} blocks to {self.path} "
                                   "(written and recorded first)") from interrupt

    def _commit(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes]) -> None:
        """One LMDB transaction (caller holds _meta_lock); pending deletes are consumed only
        once it commits."""
        n_pending = len(self._deleted)
        try:
            with self._env.begin(db=self._db, write=True) as txn:
                for k in deletes:
                    txn.delete(k)
                if puts:
                    txn.cursor().putmulti(puts)
        except lmdb.Error as e:     # aborted: nothing of it is recorded, the deletes stay pending
            raise self._index_error(e, f"record {len(puts)} blocks") from None
        del self._deleted[:n_pending]
        if self._checkpoints is not None:
            self._checkpoints.commits += 1

    def read(self, slots: Sequence[SlotId], rows: Sequence[np.ndarray], idx: Sequence[int] | None = None,
             keys: Sequence[BlockKey] | None = None) -> list[int]:
        """Copy and verify; returns the positions j whose block failed verification."""
        order = list(range(len(slots))) if idx is None else list(idx)
        bad: list[int] = []
        errors = []
        # Speed: this thread verifies each run as it lands while the I/O threads go on to
        # their next reads; hashing on the I/O thread left the disk's queue a read short.
        pending = self._parallel(self._read_run, slots, rows, order)
        try:
            for f in pending:
                try:                               # every read is finished before any error is raised:
                    part, check = f.result()       # they land in the caller's rows
                except Exception as e:
                    errors.append(e)
                    continue
                bad.extend(part)
                sums = block_checksums([data for _, data, _ in check])
                bad.extend(j for (j, _, want), got in zip(check, sums) if got != want)
        except BaseException:                      # a Ctrl-C: no read lands in rows the caller
            wait_quietly(pending)                  # has taken back
            raise
        if errors:
            raise TransferError(f"disk tier {self.path}: read failed: {errors[0]}") from errors[0]
        now = time.time()
        with self._meta_lock:
            for j, s in enumerate(slots):
                rec = self._records.get(s)
                if keys is not None and rec is not None and rec[0] != keys[j] and j not in bad:
                    bad.append(j)
                self._access[s] = now
                self._touched.add(s)
        for j in bad:
            self.corrupt += 1
            key = keys[j].hex() if keys is not None else "?"
            log.warning("disk tier %s: block %s in slot %d failed verification; treated as a miss",
                        self.path, key, slots[j])
        return sorted(set(bad))

    def _parallel(self, fn, slots: Sequence[SlotId], rows: Sequence[np.ndarray], order: list[int],
                  until_started: bool = False) -> list[Future]:
        """Split the copy into runs of consecutive slots and start them on the I/O threads, in
        slot order; their futures, in that order. With until_started, return once as many
        runs as there were idle threads (or all) have begun."""
        if self._pool is None:
            raise ClosedError(f"disk tier {self.path} is closed")
        runs: list[tuple[list[int], int]] = []   # (positions j, first slot), slots ascending
        by_slot = sorted(range(len(slots)), key=slots.__getitem__)
        for s, js in _runs_by_slot([slots[j] for j in by_slot], by_slot):
            for c in range(0, len(js), self._chunk_slots):
                runs.append((js[c:c + self._chunk_slots], s + c))
        with self._busy_lock:
            idle = self.io_threads - self._busy
        begun = threading.Semaphore(0) if until_started else None
        futures: list[Future] = []
        try:                        # a Ctrl-C here: no run goes on behind the caller's back
            for js, s0 in runs:
                futures.append(submit(self._pool, self._run, fn, begun, js, s0, rows, order))
            if begun is not None:
                for _ in range(min(idle, len(runs))):
                    begun.acquire()
        except BaseException:
            wait_quietly(futures)
            raise
        return futures

    def _run(self, fn, begun: threading.Semaphore | None, *args: Any) -> Any:
        """One run on an I/O thread, counted busy while it lasts; `begun` is released as it starts."""
        with self._busy_lock:
            self._busy += 1
        if begun is not None:
            begun.release()        # this thread keeps the GIL until its syscall lets it go
        try:
            return fn(*args)
        finally:
            with self._busy_lock:
                self._busy -= 1

    def _staging_buffer(self) -> tuple[int, mmap.mmap]:
        """One of the per-thread staging buffers (there is one per I/O thread)."""
        i = self._free_staging.pop()   # list.pop is atomic under the GIL
        return i, self._staging[i]

    def _write_run(self, js: list[int], s0: int, rows, order) -> None:
        """Write one run of consecutive slots."""
        sb, bb = self.slot_bytes, self.block_bytes
        n = len(js)
        srcs = [rows[order[j]] for j in js]
        if self.direct and sb == bb and all(_aligned(r) for r in srcs):
            _pwritev_all(self._fd, srcs, s0 * sb)          # straight from the caller's memory
            return
        i, buf = self._staging_buffer()
        try:
            view = np.frombuffer(buf, dtype=np.uint8, count=n * sb).reshape(n, sb)
            for r, src in enumerate(srcs):
                view[r, :bb] = src
            _pwritev_all(self._fd, [memoryview(buf)[: n * sb]], s0 * sb)
        finally:
            self._free_staging.append(i)

    def _read_run(self, js: list[int], s0: int, rows, order) -> tuple[list[int], list[tuple[int, np.ndarray, int]]]:
        """Read one run of consecutive slots: (positions j that failed, blocks left to verify
        as (j, their bytes, recorded checksum)). Blocks read straight into the caller's rows
        are verified by the caller; blocks read through a staging buffer are verified here,
        before they are copied out."""
        sb, bb = self.slot_bytes, self.block_bytes
        n = len(js)
        dsts = [rows[order[j]] for j in js]
        bad: list[int] = []
        if self.direct and sb == bb and all(_aligned(d) and d.flags.c_contiguous for d in dsts):
            got = _preadv_all(self._fd, [memoryview(d).cast("B") for d in dsts], s0 * sb)
            check = []
            for r, j in enumerate(js):
                rec = self._records.get(s0 + r)
                if got < (r + 1) * sb or rec is None:
                    bad.append(j)
                else:
                    check.append((j, dsts[r], rec[1]))
            return bad, check
        i, buf = self._staging_buffer()
        try:
            got = _preadv_all(self._fd, [memoryview(buf)[: n * sb]], s0 * sb)
            view = np.frombuffer(buf, dtype=np.uint8, count=n * sb).reshape(n, sb)
            for r, j in enumerate(js):
                rec = self._records.get(s0 + r)
                if got < (r + 1) * sb or rec is None or block_checksum(view[r, :bb]) != rec[1]:
                    bad.append(j)
                else:
                    dsts[r][...] = view[r, :bb]
        finally:
            self._free_staging.append(i)
        return bad, []

    def block(self, slot: SlotId) -> np.ndarray:
        out = np.empty(self.block_bytes, dtype=np.uint8)
        rec = self._records.get(slot)
        if self.read([slot], [out], keys=[rec[0]] if rec else None):
            raise ConfigError(f"disk tier {self.path}: slot {slot} failed verification")
        return out

    def release(self, slots: Sequence[SlotId], keys: Sequence[BlockKey]) -> None:
        """These blocks left the tier: their records go at the next commit."""
        with self._meta_lock:
            for s in slots:
                rec = self._records.pop(s, None)
                self._access.pop(s, None)
                self._touched.discard(s)
                if rec is not None:
                    self._deleted.append(rec[0])

    def record_order(self, slots: Sequence[SlotId], newest: bool = False) -> None:
        # Last-access times made to follow that order: a block older than the one before it
        # gets that one's time and a microsecond (recorded at the next flush); the rest keep
        # their own, so only blocks out of order are rewritten. Newest: from now on (now and
        # a microsecond each: later than any other record's, which were all set before now);
        # those are rewritten at every flush (0.12 s for 40k blocks in use above).
        prev = time.time() if newest else 0.0
        access, records, touched = self._access, self._records, self._touched
        with self._meta_lock:
            for s in slots:
                if s not in records:
                    continue
                t = access.get(s, 0.0)
                if t <= prev:
                    t = access[s] = prev + 1e-6
                    touched.add(s)
                prev = t

    def flush(self) -> None:
        """Make every completed write durable: data, then the index, synced to the device."""
        if self._env is None or self.read_only:
            return
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise TransferError(f"disk tier {self.path}: cannot sync slab.bin ({e.strerror}): the blocks written "
                                "since the last flush may not be durable; check the disk (dmesg)") from None
        with self._meta_lock:
            puts = []
            try:
                with self._env.begin(db=self._db) as txn:     # last access of the blocks read since
                    for s in self._touched:
                        rec = self._records.get(s)
                        raw = txn.get(rec[0]) if rec is not None else None
                        if raw is not None:
                            v = msgpack.unpackb(raw)
                            v[3] = self._access[s]
                            puts.append((rec[0], msgpack.packb(v)))
            except lmdb.Error as e:
                raise self._index_error(e, "flush") from None
            self._commit(puts, list(self._deleted))
            self._touched.clear()
        try:
            self._checkpoints.now()
        except lmdb.Error as e:
            raise self._index_error(e, "sync its index") from None
        except OSError as e:
            raise TransferError(f"disk tier {self.path}: cannot sync its index or save its checkpoint "
                                f"({e.strerror or e}): check the disk (dmesg)") from None

    def info(self) -> dict[str, Any]:
        return {"path": str(self.path), "io": self.io_note, "slot_bytes": self.slot_bytes,
                "persistent": True, "corrupt_blocks": self.corrupt}

    def close(self) -> None:
        if self._env is None:
            return
        try:
            self.flush()
        finally:
            self._release_handles()

    def _release_handles(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._close_env()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._drop_locks()
        for b in self._staging:
            b.close()
        self._staging = []
        if self._scratch is not None:            # a read-only tier's copy of a short index
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def _aside(where: Path) -> Path:
    """Where a damaged index is kept: index.lmdb.damaged-TIME (and .N when damaged twice
    within a second: both are kept)."""
    aside = where.with_name(f"index.lmdb.damaged-{int(time.time())}")
    n = 1
    while aside.exists():
        aside = where.with_name(f"index.lmdb.damaged-{int(time.time())}.{n}")
        n += 1
    return aside


def _runs_by_slot(slots: Sequence[SlotId], positions: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Split sorted `slots` into runs of consecutive slots: (first slot, their positions)."""
    runs = []
    j = 0
    n = len(slots)
    while j < n:
        k = 1
        while j + k < n and slots[j + k] == slots[j] + k:
            k += 1
        runs.append((slots[j], list(positions[j:j + k])))
        j += k
    return runs


def _pwritev_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(memoryview(b).nbytes for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    if done != total:   # regular files only write short when the device is full
        raise TransferError(f"short write to the disk tier ({done} of {total} bytes): is the device full?")


def _full(e: lmdb.Error) -> bool:
    """Whether LMDB failed because the filesystem is full (it reports errno as text)."""
    return os.strerror(errno.ENOSPC) in str(e) or os.strerror(errno.EDQUOT) in str(e)


def wait_quietly(futures: Sequence[Future]) -> None:
    """Wait until every future has ended, whatever they raise and however often the wait is
    interrupted (a Ctrl-C): the caller re-raises what stopped it once no I/O thread still
    writes a slot or reads into its rows."""
    while True:
        try:
            wait(futures)
            return
        except BaseException:
            continue


def _recency(last_access: float, slot: int) -> tuple[float, int]:
    """A block's place in least-recently-used order (sort ascending: oldest first). The blocks
    of one write or read share their last access; among them a higher slot counts as older:
    a chain's blocks get ascending slots in chain order (kvtier/index.py: _in_chain_order),
    so its tail goes before its root, as in the index's own order (a tail without its root
    is never a prefix hit)."""
    return last_access, -slot


def _preadv_all(fd: int, bufs: list, offset: int) -> int:
    """Bytes read; fewer than asked means the file ends early (a truncated slab)."""
    return os.preadv(fd, bufs, offset)
