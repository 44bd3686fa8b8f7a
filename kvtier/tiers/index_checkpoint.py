"""The disk tier's index as of its last sync, kept whole so that a power loss costs only
the commits after it.

The index is committed without fsync (one per put would cost more than the cache saves).
LMDB then makes no promise about a power loss: it reuses the pages of any snapshot older
than the last two, so unsynced commits overwrite pages the synced snapshot still points
to, and a meta page may reach the disk before the pages it names (a session-25 trial: 40
of 40 simulated losses lost flushed blocks or broke the index, 18 aborting every open).

A checkpoint closes that gap without a sync per commit:
- the tier syncs the index, then holds a read transaction on that snapshot, so LMDB reuses
  none of its pages until the next checkpoint (LMDB's own rule for readers);
- it saves the file's two meta pages as they are then (`synced-meta`: two checksummed
  slots written in turn, one fdatasync), since later commits overwrite them in place.
At the next open, if the machine has restarted since (Linux's boot id changed) and the
index holds commits after the checkpoint, some of them may never have reached the disk:
the saved meta pages are written back, and the index is the synced snapshot again, whose
pages nothing overwrote. After a process crash alone (same boot), the kernel still held
every commit: the newest snapshot is kept.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lmdb
import msgpack

from kvtier.tiers.lmdb_check import meta_of, newest_meta, readable_copy

log = logging.getLogger("kvtier.disk")

SAVED = "synced-meta"          # in index.lmdb/, so it moves with the index (set aside, compacted)
# A write this long after the last checkpoint, or this many commits after it, starts the
# next one: what a power loss can cost of the index. Its syncs run on a thread of their own
# (they write the pages of every commit since: about 6 ms for 256 small puts here, 6% of
# their time when a put waited for them); the snapshot it holds keeps LMDB from reusing the
# pages freed since, so the index grows by the pages of the commits in between (about 6
# each: 4,000 puts under one snapshot grew it from 0.8 to 99 MB), then reuses them.
CHECKPOINT_SECONDS = 5.0
CHECKPOINT_COMMITS = 256
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the machine ('' where the OS does not say: then a restart is not told
    from a process crash, and the newest snapshot is kept, as before checkpoints)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Checkpoint:
    """The two meta pages of a synced index, the txnid they name, the boot they were taken
    in, and data.mdb's inode (a file put in its place is not rolled back with them)."""

    txnid: int
    page_size: int
    pages: bytes
    boot: str
    inode: int
    seq: int = 0                   # the order the checkpoints were saved in (save() sets it)


def take(index_dir: Path, txnid: int) -> Checkpoint | None:
    """The meta pages `index_dir`'s data.mdb holds now, if the newest names `txnid` (the
    snapshot the caller synced and holds open); None if they do not."""
    with open(index_dir / "data.mdb", "rb") as f:
        head = f.read(2 * 65536)
        inode = os.fstat(f.fileno()).st_ino
    found = newest_meta(head)
    if found is None:
        return None
    (psize, _, newest), _ = found
    if newest != txnid or len(head) < 2 * psize:
        return None
    return Checkpoint(txnid, psize, head[:2 * psize], boot_id(), inode)


def save(index_dir: Path, cp: Checkpoint) -> None:
    """Write `cp` into the slot of index_dir/synced-meta not holding the newest checkpoint,
    synced. A write cut short leaves that slot failing its check, and the other one, whose
    snapshot the caller still holds until this returns, stands."""
    path = index_dir / SAVED
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if created:                 # both slots' blocks taken now: a full disk fails here, not midway
            _pwrite_all(fd, bytes(2 * _SLOT_BYTES), 0)
            os.fsync(fd)
            sync_dir(index_dir)
        slots = _read_slots(fd)
        newest = max(range(2), key=lambda i: slots[i].seq if slots[i] is not None else -1)
        seq = max((c.seq for c in slots if c is not None), default=0) + 1
        body = msgpack.packb({"txnid": cp.txnid, "page_size": cp.page_size, "pages": cp.pages, "boot": cp.boot,
                             "inode": cp.inode, "seq": seq})
        record = _HEAD.pack(len(body), _digest(body)) + body
        if len(record) > _SLOT_BYTES:
            raise ValueError(f"a checkpoint of {len(record)} bytes does not fit a slot")
        _pwrite_all(fd, record, (1 - newest) * _SLOT_BYTES)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def forget(index_dir: Path) -> None:
    """Remove the saved checkpoints (their snapshot is no longer held: its pages may be reused)."""
    try:
        os.unlink(index_dir / SAVED)
    except FileNotFoundError:
        return
    sync_dir(index_dir)


def load(index_dir: Path) -> Checkpoint | None:
    """The newest whole checkpoint saved, or None (none, or not one kvtier wrote: ignored)."""
    try:
        fd = os.open(index_dir / SAVED, os.O_RDONLY)
    except OSError:
        return None
    try:
        slots = [c for c in _read_slots(fd) if c is not None]
    finally:
        os.close(fd)
    return max(slots, key=lambda c: c.seq, default=None)    # the last saved (a txnid may repeat)


# synced-meta: two slots of _SLOT_BYTES (room for two 64 KiB pages, LMDB's largest), each
# [body length u32][blake2b-64 of the body][msgpack body], written in turn.
_HEAD = struct.Struct("<IQ")
_SLOT_BYTES = 2 * 65536 + 4096


def _digest(body: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def _read_slots(fd: int) -> list[Checkpoint | None]:
    out: list[Checkpoint | None] = []
    for i in range(2):
        head = os.pread(fd, _HEAD.size, i * _SLOT_BYTES)
        cp = None
        if len(head) == _HEAD.size:
            n, digest = _HEAD.unpack(head)
            body = os.pread(fd, min(n, _SLOT_BYTES - _HEAD.size), i * _SLOT_BYTES + _HEAD.size)
            if len(body) == n and _digest(body) == digest:
                try:
                    d = msgpack.unpackb(body)
                    cp = Checkpoint(int(d["txnid"]), int(d["page_size"]), bytes(d["pages"]), str(d["boot"]),
                                    int(d["inode"]), int(d["seq"]))
                except (ValueError, TypeError, KeyError, msgpack.UnpackException):
                    cp = None
                if cp is not None and (len(cp.pages) != 2 * cp.page_size or meta_of(cp.pages, 0) is None):
                    cp = None
        out.append(cp)
    return out


def _due(index_dir: Path) -> tuple[Checkpoint, int] | None:
    """(the saved checkpoint, the newest txnid in data.mdb) when data.mdb must be rolled back
    to it: the machine restarted since it was taken and the file holds later commits."""
    cp = load(index_dir)
    if cp is None or cp.boot == boot_id():
        return None                 # no checkpoint, or the same boot: the kernel kept every commit
    try:
        with open(index_dir / "data.mdb", "rb") as f:
            head = f.read(2 * cp.page_size)
            st = os.fstat(f.fileno())
    except OSError:
        return None
    found = newest_meta(head)
    newest = found[0][2] if found is not None else -1
    if newest <= cp.txnid or st.st_ino != cp.inode or st.st_size < 2 * cp.page_size:
        return None                 # nothing after the checkpoint (a clean close), or not its file
    return cp, newest


def rollback_due(index_dir: Path) -> bool:
    """Whether a store's open will roll `index_dir` back (its newest snapshot may be only
    partly on disk: nothing should read it before)."""
    return _due(index_dir) is not None


def roll_back(index_dir: Path) -> tuple[int, int] | None:
    """After a restart of the machine, make data.mdb the snapshot of its last checkpoint
    again, if it holds later commits (which may be only partly on disk). Returns
    (the newest txnid found, the checkpoint's) when it rolled back, else None."""
    due = _due(index_dir)
    if due is None:
        return None
    cp, newest = due
    _write_pages(index_dir / "data.mdb", cp)
    return newest, cp.txnid


def readable(index_dir: Path) -> Path | None:
    """For a reader that must not write the tier's files: None when LMDB can read
    `index_dir` as it is, else a new temporary directory (the caller removes it) holding a
    copy of its data.mdb made readable: as long as its newest transaction uses
    (lmdb_check.readable_copy) and rolled back to its checkpoint where a store would."""
    copy = readable_copy(index_dir)
    due = _due(index_dir)
    if due is None:
        return copy
    if copy is None:
        copy = Path(tempfile.mkdtemp(prefix="kvtier-index-"))
        shutil.copyfile(index_dir / "data.mdb", copy / "data.mdb")
    _write_pages(copy / "data.mdb", due[0])
    return copy


def _write_pages(data: Path, cp: Checkpoint) -> None:
    fd = os.open(data, os.O_RDWR)
    try:
        _pwrite_all(fd, cp.pages, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    """pwrite all of `data` (a full disk writes part of it, and says so only in the count)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        if n <= 0:
            raise OSError(f"wrote {len(data) - len(view)} of {len(data)} bytes")
        view, at = view[n:], at + n


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Takes an open index's checkpoints and holds the snapshot of the last one. The disk
    tier counts its commits here (under its lock) and asks for one when `due()`: `soon()`
    starts it on a thread of its own, `now()` (open, flush) waits for it."""

    def __init__(self, env: lmdb.Environment, index_dir: Path, slab_fd: Callable[[], int],
                 lock: threading.Lock) -> None:
        self._env, self._dir, self._slab_fd, self._lock = env, index_dir, slab_fd, lock
        self._name = str(index_dir.parent)          # the tier's directory, in warnings
        self._pin: lmdb.Transaction | None = None    # a read of the last checkpoint's snapshot
        self._busy = threading.Lock()      # one at a time: taken by its starter, released when done
        self._thread: ThreadPoolExecutor | None = None
        self._kept: list[lmdb.Transaction] = []   # snapshots a checkpoint that could not be removed may name
        self._at = 0.0                     # time.monotonic() of the last one started
        self.commits = 0                   # since the last one started (the tier counts, under `lock`)

    def due(self) -> bool:
        return self.commits >= CHECKPOINT_COMMITS or time.monotonic() - self._at >= CHECKPOINT_SECONDS

    @property
    def txnid(self) -> int | None:
        """The txnid of the snapshot held (the last checkpoint completed)."""
        return self._pin.id() if self._pin is not None else None

    def now(self) -> None:
        """Take a checkpoint and wait until it is saved (after any under way). Raises OSError
        or lmdb.Error when it cannot be."""
        with self._busy:
            started = self._start()
            if started is not None:
                self._finish(*started)

    def soon(self) -> None:
        """Start a checkpoint on the checkpoint thread, unless one is under way. Never raises:
        a failure is logged, and a later write tries again."""
        if not self._busy.acquire(blocking=False):
            return
        submitted = False
        try:
            started = self._start()
            if started is not None:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-checkpoint")
                self._thread.submit(self._finish_in_background, *started)
                submitted = True
        except (OSError, lmdb.Error) as e:
            log.warning("disk tier %s: checkpoint failed (%s); a later write tries again", self._name, e)
        finally:
            if not submitted:
                self._busy.release()

    def wait(self) -> None:
        """Until a checkpoint under way is done."""
        with self._busy:
            pass

    def close(self) -> None:
        """Wait for a checkpoint under way, then let go of the snapshot (before the index closes)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        with self._lock:
            self._unpin()
            for pin in self._kept:
                pin.abort()
            self._kept.clear()

    def _start(self) -> tuple[lmdb.Transaction, Checkpoint] | None:
        """Under the tier's lock (no commit in between): a read of the newest snapshot and its
        meta pages as the file holds them now (later commits overwrite them)."""
        with self._lock:
            self._at = time.monotonic()
            self.commits = 0
            if self._pin is not None and self._env.info()["last_txnid"] == self._pin.id():
                return None                # nothing committed since the last one
            pin = self._env.begin()
            try:
                cp = take(self._dir, pin.id())
            except BaseException:
                pin.abort()
                raise
            if cp is None:
                pin.abort()
                raise OSError(f"its meta pages do not name the newest snapshot {pin.id()}")
            return pin, cp

    def _finish(self, pin: lmdb.Transaction, cp: Checkpoint) -> None:
        try:
            fd = self._slab_fd()
            if fd >= 0:
                os.fdatasync(fd)           # the blocks before the records that name them
            self._env.sync(True)           # that snapshot's pages (and any later ones)
        except BaseException:
            with self._lock:
                pin.abort()                # the saved checkpoint, and the snapshot held, stand
            raise
        try:
            save(self._dir, cp)
        except BaseException:
            # Either slot may read as the newest now: none may stand once its snapshot is let go.
            try:
                forget(self._dir)
            except BaseException:
                with self._lock:
                    self._kept.append(pin)   # both snapshots stay held (for the process)
                raise
            with self._lock:
                pin.abort()
                self._unpin()
            raise
        with self._lock:
            old, self._pin = self._pin, pin
            if old is not None:
                old.abort()

    def _finish_in_background(self, pin: lmdb.Transaction, cp: Checkpoint) -> None:
        try:
            self._finish(pin, cp)
        except Exception as e:
            log.warning("disk tier %s: checkpoint failed (%s); a later write tries again", self._name, e)
        finally:
            self._busy.release()

    def _unpin(self) -> None:
        if self._pin is not None:
            self._pin.abort()
            self._pin = None
