"""A power loss costs the disk tier only the index commits after its last checkpoint (a
flush, or one taken by a write CHECKPOINT_SECONDS after the last): never a flushed block,
never the index, never wrong KV (kvtier.tiers.index_checkpoint)."""
import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtier
import kvtier.tiers.index_checkpoint as checkpoint
from kvtier.tiers.disk_dir import read_directory
from tests.conftest import REPO, payload
from tests.test_disk import chains, open_store

# Writes 40 chains, flushes, copies data.mdb as the device holds it then (synced), writes
# 360 more (commits that split and copy the pages of the flushed snapshot, never synced:
# no checkpoint is due), and dies without closing.
WRITER = r"""
import os, shutil, sys
import kvtier.tiers.index_checkpoint as checkpoint
from tests.test_disk import chains, open_store
from tests.conftest import payload
checkpoint.CHECKPOINT_SECONDS = checkpoint.CHECKPOINT_COMMITS = 10**9
path, synced = sys.argv[1], sys.argv[2]
store = open_store(path, host=8, disk=2048)
cs = chains(store, 400)
for i, keys in enumerate(cs):
    store.put(keys, payload(keys, store.layout.block_bytes))
    if i == 39:
        store.flush()
        shutil.copyfile(os.path.join(path, "index.lmdb", "data.mdb"), synced)
print("ready", flush=True)
os._exit(0)
"""

# Opens the tier after a restart of the machine (another boot id): what `kvtier inspect`
# reads, then what a store serves of the flushed chains and of the later ones.
CHECK = r"""
import logging, sys
import kvtier.tiers.index_checkpoint as checkpoint
from kvtier.tiers.disk_dir import read_directory
from tests.test_disk import chains, open_store
from tests.test_disk_power_loss import served
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
checkpoint.boot_id = lambda: "the next boot"
path = sys.argv[1]
print("inspect", len(read_directory(path)[1]), flush=True)
store = open_store(path, host=8, disk=2048)
cs = chains(store, 400)
whole = [0, 0]
for i, keys in enumerate(cs):
    whole[i >= 40] += served(store, keys) == len(keys)
print("whole", *whole, flush=True)
store.close()
"""


def served(store: kvtier.Store, keys) -> int:
    """How many blocks of `keys` the store serves (a prefix), checked byte for byte."""
    n = store.lookup(keys).blocks
    out = torch.zeros(n, store.layout.block_bytes, dtype=torch.uint8)
    got = store.get(keys[:n], out).loaded if n else 0
    assert (out[:got] == payload(keys[:got], store.layout.block_bytes)).all(), "wrong KV served"
    return got


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def _lose_power(path: Path, synced: Path) -> None:
    """data.mdb as a power loss may leave it: the synced file plus two of every three of the
    pages written after it (the meta pages among them), the rest as they were at the sync."""
    data = path / "index.lmdb" / "data.mdb"
    old, new = synced.read_bytes(), data.read_bytes()
    assert len(new) >= len(old)
    img = bytearray(old + bytes(len(new) - len(old)))
    for pg in range(len(new) // 4096):
        at = slice(pg * 4096, (pg + 1) * 4096)
        if pg < 2 or pg % 3:
            img[at] = new[at]
    with open(data, "r+b") as f:          # the same file (inode): written over in place
        f.write(img)


def test_a_power_loss_after_a_flush_keeps_every_flushed_block(tmp_path):
    """Before checkpoints, LMDB reused the flushed snapshot's pages for the unsynced commits
    after it, and a power loss left an index that lost the flushed blocks, was set aside, or
    aborted the process at every open (40 of 40 simulated losses in a session-25 trial)."""
    path, synced = tmp_path / "kv", tmp_path / "synced.mdb"
    w = _run(WRITER, str(path), str(synced))
    assert w.returncode == 0 and "ready" in w.stdout, w.stderr[-2000:]
    _lose_power(path, synced)
    before = (path / "index.lmdb" / "data.mdb").read_bytes()
    r = _run(CHECK, str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["inspect"] == str(40 * 4)          # the reader saw the flushed snapshot...
    flushed, later = map(int, lines["whole"].split())
    assert flushed == 40                            # ...and the store serves all of it
    assert later == 0                               # (the commits after it are rolled back)
    assert "the machine restarted since this index was last synced" in r.stderr
    assert "damaged" not in r.stderr
    assert len(list(path.glob("index.lmdb.damaged*"))) == 0
    assert before != (path / "index.lmdb" / "data.mdb").read_bytes()   # the store rolled it back


def test_a_process_crash_keeps_every_commit(tmp_path):
    """A crash of the process alone (the same boot): the kernel holds every commit, the
    newest snapshot is kept, nothing is rolled back."""
    path, synced = tmp_path / "kv", tmp_path / "synced.mdb"
    w = _run(WRITER, str(path), str(synced))
    assert w.returncode == 0, w.stderr[-2000:]
    assert checkpoint.load(path / "index.lmdb").boot == checkpoint.boot_id()
    store = open_store(path, host=8, disk=2048)
    got = [served(store, keys) for keys in chains(store, 400)]
    assert got[:-2] == [4] * 398         # (the last 2 were in host memory only)
    store.close()


def test_a_clean_close_rolls_back_nothing_after_a_restart(tmp_path, monkeypatch, caplog):
    store = open_store(tmp_path / "kv", host=8, disk=256)
    cs = chains(store, 20)
    for keys in cs:
        store.put(keys, payload(keys, store.layout.block_bytes))
    store.close()
    monkeypatch.setattr(checkpoint, "boot_id", lambda: "the next boot")
    with caplog.at_level(logging.WARNING, logger="kvtier.disk"):
        store = open_store(tmp_path / "kv", host=8, disk=256)
        assert [served(store, keys) for keys in cs] == [4] * 20
        store.close()
    assert "restarted" not in caplog.text


@pytest.mark.parametrize("due", ["seconds", "commits"])
def test_a_checkpoint_is_taken_by_a_write_once_due(tmp_path, monkeypatch, due):
    """Without a flush, a write CHECKPOINT_SECONDS or CHECKPOINT_COMMITS after the last
    checkpoint takes one: the index a power loss goes back to is at most that old."""
    monkeypatch.setattr(checkpoint, "CHECKPOINT_COMMITS", 10**9)
    store = open_store(tmp_path / "kv", host=4, disk=256)
    cs = chains(store, 30)
    index = tmp_path / "kv" / "index.lmdb"
    at_open = checkpoint.load(index).txnid
    store.put(cs[0], payload(cs[0], store.layout.block_bytes))
    store.put(cs[1], payload(cs[1], store.layout.block_bytes))
    assert checkpoint.load(index).txnid == at_open          # not due yet
    monkeypatch.setattr(checkpoint, "CHECKPOINT_SECONDS" if due == "seconds" else "CHECKPOINT_COMMITS", 0)
    for keys in cs[2:]:
        store.put(keys, payload(keys, store.layout.block_bytes))
    store.tiers[1]._checkpoints.wait()                      # (its syncs run on a thread of their own)
    saved = checkpoint.load(index)
    assert saved.txnid > at_open and saved.txnid == store.tiers[1]._checkpoints.txnid
    store.close()


def test_a_checkpoint_cut_short_leaves_the_one_before(tmp_path):
    """The two slots of synced-meta are written in turn: a write cut short fails its check
    and the one before it, whose snapshot was still held, is the checkpoint."""
    store = open_store(tmp_path / "kv", host=4, disk=64)
    index = tmp_path / "kv" / "index.lmdb"
    first = checkpoint.load(index)
    for keys in chains(store, 4):
        store.put(keys, payload(keys, store.layout.block_bytes))
    store.close()
    second = checkpoint.load(index)
    assert second.txnid > first.txnid
    raw = bytearray((index / checkpoint.SAVED).read_bytes())
    fd = os.open(index / checkpoint.SAVED, os.O_RDONLY)
    slot = [c.txnid if c else -1 for c in checkpoint._read_slots(fd)].index(second.txnid)
    os.close(fd)
    at = slot * checkpoint._SLOT_BYTES + 200
    raw[at:at + 4096] = bytes(4096)                       # part of the newest slot never written
    (index / checkpoint.SAVED).write_bytes(raw)
    older = checkpoint.load(index)
    assert older is not None and older.txnid < second.txnid


def test_the_index_stops_growing_while_checkpoints_move_on(tmp_path, monkeypatch):
    """A checkpoint's snapshot keeps LMDB from reusing the pages freed after it, until the
    next one: with checkpoints moving on, churn (puts evicting older blocks) reuses pages."""
    monkeypatch.setattr(checkpoint, "CHECKPOINT_SECONDS", 0.0)
    store = open_store(tmp_path / "kv", host=4, disk=64)
    data = tmp_path / "kv" / "index.lmdb" / "data.mdb"
    sizes = []
    for round_ in range(3):
        for i in range(100):
            keys = store.keys([round_ * 1000 + i] * (4 * store.layout.block_tokens))
            store.put(keys, payload(keys, store.layout.block_bytes))
            store.tiers[1]._checkpoints.wait()    # (each done before the next write: none skipped)
        sizes.append(data.stat().st_size)
    store.close()
    assert sizes[2] <= sizes[1] * 1.1, sizes


def test_a_checkpoint_for_another_file_is_never_applied(tmp_path, monkeypatch):
    """A data.mdb put in the index's place (a copy, a restore from a backup) is not the file
    the saved meta pages belong to: they are not written into it."""
    store = open_store(tmp_path / "kv", host=4, disk=64)
    for keys in chains(store, 8):
        store.put(keys, payload(keys, store.layout.block_bytes))
    store.close()
    index = tmp_path / "kv" / "index.lmdb"
    saved = checkpoint.load(index)
    checkpoint.forget(index)
    checkpoint.save(index, dataclasses.replace(saved, txnid=saved.txnid - 1))   # as if commits followed it
    monkeypatch.setattr(checkpoint, "boot_id", lambda: "the next boot")
    assert checkpoint.rollback_due(index)
    shutil.copyfile(index / "data.mdb", tmp_path / "copy")
    os.replace(tmp_path / "copy", index / "data.mdb")   # the same bytes, another file
    assert not checkpoint.rollback_due(index)
    assert checkpoint.roll_back(index) is None
    assert len(read_directory(tmp_path / "kv")[1]) == 8 * 4


# A process crashed after commits past its last checkpoint; the next one opens the tier,
# its open writes the index (a new capacity recorded), and the power goes before the open
# is done: the machine restarts with every page written.
OPENER = r"""
import os, sys
import kvtier.tiers.disk as disk
from tests.test_disk import open_store
load = disk.DiskTier._load_records
def load_and_die(self, slots):
    load(self, slots)
    print("ready", flush=True)
    os._exit(0)
disk.DiskTier._load_records = load_and_die
open_store(sys.argv[1], host=8, disk=int(sys.argv[2]))
"""


def test_a_power_loss_after_an_open_that_wrote_keeps_the_index(tmp_path):
    """The checkpoint an earlier process saved is not held by the next one: the open's own
    writes (the new capacity, dropped records) reused its pages, and a power loss before the
    open's own checkpoint rolled back onto them (the index read as another program's, and
    the store refused it). The open takes a checkpoint before it writes."""
    path, synced = tmp_path / "kv", tmp_path / "synced.mdb"
    code = WRITER.replace("chains(store, 400)", "chains(store, 80)")
    w = _run(code, str(path), str(synced))
    assert w.returncode == 0, w.stderr[-2000:]
    o = _run(OPENER, str(path), "1024")
    assert o.returncode == 0 and "ready" in o.stdout, o.stderr[-2000:]
    r = _run(CHECK.replace("chains(store, 400)", "chains(store, 80)").replace("disk=2048", "disk=1024"), str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    flushed, later = map(int, dict(line.split(" ", 1) for line in r.stdout.splitlines())["whole"].split())
    assert flushed == 40 and later == 38     # and the later ones the same boot kept (2 were in host memory)


def test_the_last_saved_checkpoint_is_the_one_loaded_and_a_short_write_is_an_error(tmp_path, monkeypatch):
    """Two checkpoints of one txnid (a clean close, then the next boot's open) tied, and the
    older boot's could win: a crash then rolled back commits the kernel had kept. And a
    write cut short by a full disk returned normally, leaving the saved checkpoint naming a
    snapshot no longer held."""
    store = open_store(tmp_path / "kv", host=4, disk=64)
    store.close()
    index = tmp_path / "kv" / "index.lmdb"
    cp = checkpoint.load(index)
    for boot in ("boot one", "boot two", "boot three"):
        checkpoint.save(index, dataclasses.replace(cp, boot=boot))
        assert checkpoint.load(index).boot == boot
    monkeypatch.setattr(checkpoint.os, "pwrite", lambda fd, data, at: len(data) // 2 or 0)
    try:
        checkpoint.save(index, dataclasses.replace(cp, boot="boot four"))
    except OSError:
        pass
    else:
        raise AssertionError("a short write was not an error")
