"""The disk tier: persistent, crash-safe, and never returns bytes that fail verification."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

import kvtier
import kvtier.store
from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers.disk_dir import read_directory
from tests.conftest import REPO, payload

# 8 KiB blocks: a multiple of 4 KiB, so O_DIRECT goes straight from/to page-aligned memory.
LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
ODD = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)  # 512 B
NS = kvtier.Namespace("disk-test", "r1")


def open_store(path: Path, layout=LAYOUT, host=4, disk=64, ns=NS, **kw) -> kvtier.Store:
    return kvtier.Store(layout, [kvtier.HostTier(blocks=host), kvtier.DiskTier(path, blocks=disk)], ns, **kw)


def chains(store: kvtier.Store, n: int, blocks: int = 4) -> list[kvtier.BlockKeys]:
    bt = store.layout.block_tokens
    return [store.keys([1000 + i] * (blocks * bt)) for i in range(n)]


def read(store: kvtier.Store, keys) -> tuple[int, torch.Tensor]:
    out = torch.zeros(len(keys), store.layout.block_bytes, dtype=torch.uint8)
    return store.get(keys, out).loaded, out


@pytest.mark.parametrize("layout", [LAYOUT, ODD], ids=["aligned", "unaligned"])
def test_evicted_blocks_are_served_from_disk_byte_exact(tmp_path, layout):
    store = open_store(tmp_path / "kv", layout=layout, promote=False)
    cs = chains(store, 6)
    for k in cs:
        store.put(k, payload(k, layout.block_bytes))
    assert store.lookup(cs[0]).by_tier() == {"host": 0, "disk": 4}
    for k in cs:
        loaded, out = read(store, k)
        assert loaded == 4 and torch.equal(out, payload(k, layout.block_bytes))
    info = store.stats().tier("disk").info
    assert info["persistent"] and info["slot_bytes"] % 4096 == 0
    store.close()


def test_a_disk_hit_is_promoted_and_prefetch_warms_the_host(tmp_path):
    store = open_store(tmp_path / "kv", host=8)
    a, b, c = chains(store, 3)
    for k in (a, b, c):
        store.put(k, payload(k, LAYOUT.block_bytes))
    assert store.lookup(a).by_tier() == {"host": 0, "disk": 4}
    read(store, a)
    assert store.lookup(a).by_tier() == {"host": 4, "disk": 0}
    assert store.lookup(b).by_tier() == {"host": 0, "disk": 4}
    t = store.prefetch(b).wait()
    assert t.loaded == 4 and store.lookup(b).by_tier() == {"host": 4, "disk": 0}
    store.close()


def test_restart_finds_yesterdays_prefixes(tmp_path):
    store = open_store(tmp_path / "kv")
    cs = chains(store, 5)
    for k in cs:
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.close()                       # flushes: host-only blocks are written down too
    again = open_store(tmp_path / "kv")
    assert again.stats().recovered_blocks == 20
    for k in cs:
        assert again.lookup(k).by_tier() == {"host": 0, "disk": 4}
        loaded, out = read(again, k)
        assert loaded == 4 and torch.equal(out, payload(k, LAYOUT.block_bytes))
    again.close()


def test_write_through_keeps_a_disk_copy_of_every_put(tmp_path):
    store = open_store(tmp_path / "kv", write_through=True)
    a = chains(store, 1)[0]
    store.put(a, payload(a, LAYOUT.block_bytes))
    assert store.stats().tier("disk").used_blocks == 4 and store.lookup(a).by_tier() == {"host": 4, "disk": 0}
    b = chains(store, 2)[1]
    store.put(b, payload(b, LAYOUT.block_bytes))     # a's host copies go: no demotion I/O needed
    s = store.stats()
    assert s.tier("disk").demoted_in == 0 and s.tier("disk").used_blocks == 8
    assert store.lookup(a).by_tier() == {"host": 0, "disk": 4}
    loaded, out = read(store, a)
    assert loaded == 4 and torch.equal(out, payload(a, LAYOUT.block_bytes))
    store.close()


def test_another_layout_or_namespace_is_refused(tmp_path):
    open_store(tmp_path / "kv").close()
    with pytest.raises(ConfigError, match="another layout.*kvtier inspect") as e:
        open_store(tmp_path / "kv", layout=ODD)
    differ = [k for k in LAYOUT.to_dict() if LAYOUT.to_dict()[k] != ODD.to_dict().get(k)]
    assert differ and all(k in str(e.value) for k in differ)                 # says which fields differ
    assert "{" not in str(e.value)                                            # and not as two whole dicts
    with pytest.raises(ConfigError, match="by model 'disk-test' revision 'r1'.*this store is model 'other-model'"):
        open_store(tmp_path / "kv", ns=kvtier.Namespace("other-model"))
    open_store(tmp_path / "kv").close()   # the right store still opens it


def test_one_process_at_a_time(tmp_path):
    s = open_store(tmp_path / "kv")
    with pytest.raises(kvtier.TierInUseError, match=r"in use by another store \(in this process or another\)"):
        open_store(tmp_path / "kv")
    (tmp_path / "kv" / "lock").unlink()   # let a second store in, each then dropping the other's records
    with pytest.raises(kvtier.TierInUseError, match=r"in use by another store"):
        open_store(tmp_path / "kv")
    s.close()
    open_store(tmp_path / "kv").close()


def test_flipped_bytes_are_misses_not_data(tmp_path):
    store = open_store(tmp_path / "kv", promote=False)
    cs = chains(store, 4)
    for k in cs:
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.flush()
    victim = cs[0]
    slot = store.index.entries[victim[2]].slot
    with open(tmp_path / "kv" / "slab.bin", "r+b") as f:     # flip one byte of block 2
        f.seek(slot * 8192 + 100)
        b = f.read(1)
        f.seek(slot * 8192 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    loaded, out = read(store, victim)
    assert loaded == 2                                     # blocks 0-1 good; recompute from 2
    assert torch.equal(out[:2], payload(victim[:2], LAYOUT.block_bytes))
    assert store.lookup(victim).blocks == 2                # the bad copy is gone
    st = store.stats()
    assert st.counters.corrupt_blocks == 1 and st.tier("disk").info["corrupt_blocks"] == 1
    loaded, _ = read(store, cs[1])                         # the store keeps serving
    assert loaded == 4
    store.close()


def test_truncated_slab_reopens_and_serves_what_is_left(tmp_path):
    store = open_store(tmp_path / "kv", host=4, disk=32)
    cs = chains(store, 6)
    for k in cs:
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.close()
    os.truncate(tmp_path / "kv" / "slab.bin", 10 * 8192)   # by hand, behind the store's back
    again = open_store(tmp_path / "kv", host=4, disk=32)
    assert 0 < again.stats().recovered_blocks <= 10
    for k in cs:
        n = again.lookup(k).blocks
        loaded, out = read(again, k[:n])
        assert loaded == n and torch.equal(out, payload(k[:n], LAYOUT.block_bytes))
    again.close()


def test_shrinking_keeps_what_still_fits_and_growing_keeps_all(tmp_path):
    """A smaller tier keeps its most recently used blocks, wherever they were: those past
    the new end move into slots below it that less recently used blocks leave; whole
    chains stay (their roots with them). Every block found reads back byte-exact."""
    store = open_store(tmp_path / "kv", host=4, disk=64)
    cs = chains(store, 5)                               # 20 blocks, 4 chains of 4
    for k in cs:
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.close()
    smaller = open_store(tmp_path / "kv", host=4, disk=32)
    assert smaller.stats().recovered_blocks == 20       # all fit in 32 slots
    for k in cs:                                        # read in order: the last chain is the most recent
        loaded, out = read(smaller, k)
        assert loaded == 4 and torch.equal(out, payload(k, LAYOUT.block_bytes))
    smaller.close()
    _, records = read_directory(tmp_path / "kv")
    assert max(rec[0] for _, rec in records) >= 12      # the case: recent blocks past the new end
    tiny = open_store(tmp_path / "kv", host=4, disk=12)
    assert tiny.stats().recovered_blocks == 12          # 12 of 20 fit: the 3 most recent chains
    assert [tiny.lookup(k).blocks for k in cs] == [0, 0, 4, 4, 4]
    for k in cs[2:]:
        loaded, out = read(tiny, k)
        assert loaded == 4 and torch.equal(out, payload(k, LAYOUT.block_bytes))
    tiny.close()
    grown = open_store(tmp_path / "kv", host=4, disk=128)
    assert grown.stats().recovered_blocks == 12
    grown.close()


def test_a_restarted_tier_evicts_a_chains_tail_before_its_root(tmp_path):
    """The blocks of one write or read share their last access; after a restart the tier
    used to order them by key, and could evict a prefix's root while keeping its tail (no
    use to a prefix cache). Restarted or not, the same puts leave the same prefix cached."""
    def run(restart: bool) -> int:
        path = tmp_path / f"kv{restart}"
        store = kvtier.Store(LAYOUT, [kvtier.DiskTier(path, blocks=10)], NS)
        chain, other = chains(store, 1, blocks=10)[0], store.keys([7] * (4 * LAYOUT.block_tokens))
        store.put(chain, payload(chain, LAYOUT.block_bytes))
        assert read(store, chain)[0] == 10              # all ten read together: one access time
        if restart:
            store.close()
            store = kvtier.Store(LAYOUT, [kvtier.DiskTier(path, blocks=10)], NS)
        store.put(other, payload(other, LAYOUT.block_bytes))   # evicts 4
        n = store.lookup(chain).blocks
        store.close()
        return n
    assert run(False) == run(True) == 6


def test_another_programs_lmdb_is_refused_and_left_alone(tmp_path):
    """A directory whose index.lmdb another program wrote: the store wrote its own
    databases into it beside the other's keys; now it refuses, and writes nothing there."""
    import lmdb
    (tmp_path / "kv").mkdir()
    env = lmdb.open(str(tmp_path / "kv" / "index.lmdb"))
    with env.begin(write=True) as txn:
        txn.put(b"theirs", b"1")
    env.close()
    with pytest.raises(ConfigError, match="kvtier did not write"):
        open_store(tmp_path / "kv")
    env = lmdb.open(str(tmp_path / "kv" / "index.lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        assert [bytes(k) for k, _ in txn.cursor()] == [b"theirs"]
    env.close()
    assert not (tmp_path / "kv" / "slab.bin").exists()


def test_bad_paths_and_sizes(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory|cannot create"):
        open_store(tmp_path / "file")
    with pytest.raises(CapacityError, match="free space|too large"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "big", capacity="900TiB")], NS)
    with pytest.raises(ConfigError, match="holds no kvtier disk tier"):
        read_directory(tmp_path / "empty")
    open_store(tmp_path / "ro").close()
    with pytest.raises(ConfigError, match="read-only: a store writes"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "ro", blocks=64, read_only=True)], NS)
    with pytest.raises(ConfigError, match="needs a directory path"):
        kvtier.DiskTier(None, blocks=8)
    with pytest.raises(ConfigError, match="needs a directory path"):
        kvtier.DiskTier(str(tmp_path / "a\0b"), blocks=8)            # was ValueError: embedded null byte
    with pytest.raises(ConfigError, match="fastest first"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "up", blocks=4), kvtier.HostTier(blocks=8)], NS)
    with pytest.raises(ConfigError, match="is not on a disk"):          # not "0 B is free"
        kvtier.Store(LAYOUT, [kvtier.DiskTier("/proc/kvtier-test", blocks=8)], NS)
    with pytest.raises(ConfigError, match="direct must be"):
        kvtier.DiskTier(tmp_path / "d", blocks=8, direct="yes")
    with pytest.raises(ConfigError, match="io_threads must be a whole number from 1 to 64"):
        kvtier.DiskTier(tmp_path / "d", blocks=8, io_threads=100_000)   # was ENOMEM at build, lock kept


def test_a_read_only_filesystem_is_named_not_called_too_small(tmp_path, monkeypatch):
    """A small read-only filesystem was "not enough free space ... 10 MiB is free", the cause
    (nothing can be written there) shown only for a tier small enough to fit."""
    import os as os_mod
    from kvtier.tiers import disk_dir
    real = os_mod.statvfs

    class ReadOnly:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)

        f_flag = os_mod.ST_RDONLY
        f_bavail = 10

    monkeypatch.setattr(disk_dir.os, "statvfs", lambda p: ReadOnly(real(p)))
    with pytest.raises(ConfigError, match="is on a read-only filesystem; give a directory you can write"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv", capacity="1GiB")], NS)
    assert not (tmp_path / "kv").exists()


def test_a_folder_holding_other_files_is_refused_and_left_alone(tmp_path):
    """`--disk /etc` created a 16 GiB slab and an index among /etc's files, and a folder's
    own slab.bin was resized and reused: a directory holding anything but a tier is refused."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "slab.bin").write_bytes(b"another program's file")
    before = sorted((p.name, p.stat().st_size) for p in other.iterdir())
    with pytest.raises(ConfigError, match=r"already holds files that are not a kvtier disk tier \(notes.txt\)"):
        open_store(other)
    assert sorted((p.name, p.stat().st_size) for p in other.iterdir()) == before
    (tmp_path / "empty").mkdir()
    open_store(tmp_path / "empty").close()                 # an existing empty folder, a new one: fine
    open_store(tmp_path / "new" / "deeper").close()
    leftover = tmp_path / "leftover"                      # a tier's own files, its index gone
    open_store(leftover).close()
    shutil.rmtree(leftover / "index.lmdb")
    open_store(leftover).close()
    tier = tmp_path / "tier"                              # a tier beside a damaged index set aside
    open_store(tier).close()
    (tier / "index.lmdb.damaged-1").mkdir()
    open_store(tier).close()


def test_a_folder_this_user_cannot_write_is_one_config_error(tmp_path, monkeypatch):
    # (root writes through permission bits, so the refusal is simulated at os.open)
    real = os.open

    def refuse(path, *a, **kw):
        if str(path).startswith(str(tmp_path / "kv")):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ConfigError, match=r"cannot open disk tier .*: Operation not permitted \(.*kv\): "
                                          "give a directory this user can write"):
        open_store(tmp_path / "kv")
    monkeypatch.setattr(os, "open", real)
    open_store(tmp_path / "kv").close()        # nothing was left locked or half-made


def test_a_disk_tier_given_no_size_reopens_at_the_size_it_had(tmp_path):
    """DiskTier(path) needed a capacity even where the folder records one (StoreConfig did not)."""
    with pytest.raises(ConfigError, match="no tier there to reopen at its size: give a new one a capacity"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv")], NS)
    store = open_store(tmp_path / "kv")
    keys = store.keys(list(range(4 * LAYOUT.block_tokens)))
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    blocks = store.tiers[1].capacity_blocks
    store.close()
    again = kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv")], NS)
    assert again.tiers[0].capacity_blocks == blocks and again.stats().recovered_blocks == 4
    out = torch.empty(4, LAYOUT.block_bytes, dtype=torch.uint8)
    assert again.get(keys, out).loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    again.close()
    with pytest.raises(ConfigError, match="exactly one of capacity"):
        kvtier.DiskTier(tmp_path / "kv", capacity="1GiB", blocks=8)


@pytest.mark.parametrize("where", ["checksums", "wait"])
def test_a_ctrl_c_while_evictions_are_written_down_leaves_a_sound_store(tmp_path, monkeypatch, where):
    """A KeyboardInterrupt while a put wrote evicted blocks down left the put's keys reserved
    for good (a retried put found them "present" and stored nothing), the index claiming
    blocks on disk with no record behind them, and writes still running into slots reused
    after (committed blocks there then failed verification)."""
    import threading

    import kvtier.tiers.disk as disk

    store = open_store(tmp_path / "kv", host=8, disk=256)
    chains_ = [store.keys([7000 + i] * (6 * LAYOUT.block_tokens)) for i in range(4)]
    for keys in chains_[:3]:
        store.put(keys, payload(keys, LAYOUT.block_bytes))
    real, writing = disk._pwritev_all, threading.Event()

    def slow(fd, bufs, off):                 # a slow disk: the writes are in flight when Ctrl-C comes
        writing.set()
        time.sleep(0.3)
        return real(fd, bufs, off)

    fired: list[int] = []

    def interrupt_once(real):                # one Ctrl-C, on this thread, while the I/O threads write
        def call(*a, **k):
            if threading.current_thread() is threading.main_thread() and not fired:
                fired.append(1)
                writing.wait(5)
                raise KeyboardInterrupt
            return real(*a, **k)
        return call

    monkeypatch.setattr(disk, "_pwritev_all", slow)
    if where == "checksums":                 # as the calling thread hashes the blocks
        monkeypatch.setattr(disk, "block_checksums", interrupt_once(disk.block_checksums))
    else:                                    # or as it waits for the writes
        monkeypatch.setattr(disk.Future, "result", interrupt_once(disk.Future.result))
    last = chains_[3]
    with pytest.raises(KeyboardInterrupt):
        store.put(last, payload(last, LAYOUT.block_bytes))
    monkeypatch.undo()
    # the evictions under way were finished and recorded before the interrupt went on: every
    # acknowledged chain is whole (they were dropped: 18 reachable blocks became 8)
    assert [store.lookup(keys).blocks for keys in chains_[:3]] == [6, 6, 6]
    assert store.lookup(last).blocks == 0
    t = store.put(last, payload(last, LAYOUT.block_bytes))       # not stuck "present"
    assert (t.blocks, t.present) == (6, 0) and store.lookup(last).blocks == 6

    def readable() -> int:
        n = 0
        for keys in chains_:
            hit = store.lookup(keys).blocks
            out = torch.empty(hit, LAYOUT.block_bytes, dtype=torch.uint8)
            if hit:
                assert store.get(keys[:hit], out).loaded == hit
                assert torch.equal(out, payload(keys[:hit], LAYOUT.block_bytes))
            n += hit
        return n

    assert readable() >= 6
    st = store.stats()
    assert st.tier("host").used_blocks <= 8 and st.counters.corrupt_blocks == 0
    store.close()
    store = open_store(tmp_path / "kv", host=8, disk=256)
    assert readable() >= 6 and store.stats().counters.corrupt_blocks == 0   # no stale write landed
    store.close()


@pytest.mark.parametrize("where", ["_start_write", "_commit"])
def test_a_real_ctrl_c_during_a_demotion_waits_for_it(tmp_path, monkeypatch, where):
    """A SIGINT landing in a put's demotion of evicted blocks (before their writes started, or
    in the index's commit) failed the demotion and dropped the blocks: a completed put's chain
    lost, no warning (7 of 30 random Ctrl-Cs in a trial). The signal now waits for the put."""
    import kvtier.tiers.disk as disk

    store = open_store(tmp_path / "kv", host=4, disk=64)
    first, second = chains(store, 2, blocks=4)
    store.put(first, payload(first, LAYOUT.block_bytes))
    real = getattr(disk.DiskTier, where)

    def signalled(self, *a, **k):              # the signal arrives as the demotion runs
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(disk.DiskTier, where, signalled)
    with pytest.raises(KeyboardInterrupt):      # raised once the put is done
        store.put(second, payload(second, LAYOUT.block_bytes))
    monkeypatch.undo()
    for keys in (first, second):                # the evicted chain went down whole
        n, out = read(store, keys)
        assert n == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    store.close()
    store = open_store(tmp_path / "kv", host=4, disk=64)
    assert read(store, first)[0] == 4
    store.close()


def test_a_ctrl_c_in_a_save_written_in_place_leaves_nothing_reserved(tmp_path, monkeypatch):
    """A SIGINT during write_in_place's reservation (the engine's save path) was raised as the
    reservation returned, before the save kept it: its keys stayed reserved, so lookup never
    found them and a retried put stored nothing ("present 4"). It now waits for the save."""
    store = open_store(tmp_path / "kv", host=4, disk=64)
    keys = chains(store, 1)[0]
    rows = payload(keys, LAYOUT.block_bytes)
    real = store.index.reserve

    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    def write(w):
        w.memory[w.slots] = rows[w.positions]

    monkeypatch.setattr(store.index, "reserve", signalled)
    with pytest.raises(KeyboardInterrupt):
        store.write_in_place(keys, write)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    n, out = read(store, keys)                  # the save was committed whole
    assert n == 4 and torch.equal(out, rows)
    store.close()


@pytest.mark.parametrize("where", ["_start_write", "_commit"])
def test_a_ctrl_c_during_a_promotion_keeps_the_blocks_it_demotes(tmp_path, monkeypatch, where):
    """A get() promoting disk blocks into a full host tier demotes others to disk, as a put
    does; a SIGINT there dropped the demoted blocks of a completed put (not deferred)."""
    import kvtier.tiers.disk as disk

    store = open_store(tmp_path / "kv", host=4, disk=64, promote=True)
    first, second = chains(store, 2, blocks=4)
    store.put(first, payload(first, LAYOUT.block_bytes))
    store.put(second, payload(second, LAYOUT.block_bytes))   # `first` went down to disk
    real = getattr(disk.DiskTier, where)

    def signalled(self, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(disk.DiskTier, where, signalled)
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    with pytest.raises(KeyboardInterrupt):      # raised once the get is done
        store.get(first, out)
    monkeypatch.undo()
    for keys in (first, second):                # `second`, demoted by the promotion, whole
        n, out = read(store, keys)
        assert n == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    store.close()


def test_a_ctrl_c_as_a_put_starts_its_first_writes_leaves_nothing_reserved(tmp_path, monkeypatch):
    """A put made in parts (a disk top tier) interrupted while its first part's writes started
    kept that part's keys reserved: a retry found them present and stored nothing there."""
    import threading

    import kvtier.store as store_module

    monkeypatch.setattr(store_module, "PIPELINE_HEAD_BYTES", 2 * LAYOUT.block_bytes)   # parts of 2 blocks
    store = kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv", blocks=64)], NS)
    keys = store.keys(list(range(8 * LAYOUT.block_tokens)))
    real = threading.Semaphore

    class Interrupted(real):                  # the wait for the I/O threads to start
        def acquire(self, *a, **k):
            threading.Semaphore = real
            raise KeyboardInterrupt

    monkeypatch.setattr(threading, "Semaphore", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put(keys, payload(keys, LAYOUT.block_bytes))
    monkeypatch.setattr(threading, "Semaphore", real)
    t = store.put(keys, payload(keys, LAYOUT.block_bytes))
    assert (t.blocks, t.present, store.lookup(keys).blocks) == (8, 0, 8)
    out = torch.empty(8, LAYOUT.block_bytes, dtype=torch.uint8)
    assert store.get(keys, out).loaded == 8 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    store.close()


@pytest.mark.parametrize("policy", ["lru", "arc", "lfu", "s3fifo", "reuse"])
def test_a_shrunk_or_restarted_tier_keeps_the_shared_roots_in_use(tmp_path, policy):
    """Hits above (and puts finding a block present) never reached a disk record's last
    access, so shared roots, written down first, looked oldest: a shrunk tier kept old tails
    and no root (a helper's run: 0 of 400 requests kept their root at a quarter of the size).
    The order recorded is the policy's own (it was LRU's only: under ARC, LFU, S3-FIFO or
    reuse a shrunk tier still kept no root)."""
    bt = LAYOUT.block_tokens

    def chain(store: kvtier.Store, i: int) -> kvtier.BlockKeys:
        return store.keys([90_000 + i % 5] * (2 * bt) + [i] * (3 * bt))    # 2 shared blocks, 3 own

    store = open_store(tmp_path / "kv", host=8, disk=512, policy=policy)
    for i in range(100):
        keys = chain(store, i)
        store.put(keys, payload(keys, LAYOUT.block_bytes))
    store.close()
    store = open_store(tmp_path / "kv", host=8, disk=64, policy=policy)   # shrunk: the 64 most recent stay
    assert all(store.lookup(chain(store, i)).blocks >= 2 for i in range(100))
    assert store.lookup(chain(store, 99)).blocks == 5
    store.close()


def test_a_capacity_in_bytes_bounds_the_slab(tmp_path):
    """Slots are 4 KiB-aligned (O_DIRECT): 8 MiB of 512-byte blocks is 2,048 slots of 4 KiB,
    an 8 MiB slab (it was 16,384 slots: a 64 MiB slab for an 8 MiB tier)."""
    store = kvtier.Store(ODD, [kvtier.DiskTier(tmp_path / "kv", "8MiB")], NS)
    assert store.tiers[0].capacity_blocks == 2048
    assert (tmp_path / "kv" / "slab.bin").stat().st_size == 8 << 20
    store.close()
    with pytest.raises(ConfigError, match="smaller than one block \\(4096 bytes"):
        kvtier.Store(ODD, [kvtier.DiskTier(tmp_path / "small", "1KiB")], NS)


def test_buffered_io_when_asked(tmp_path):
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4), kvtier.DiskTier(tmp_path / "kv", blocks=16, direct=False)], NS,
                         promote=False)
    a, b = chains(store, 2)
    store.put(a, payload(a, LAYOUT.block_bytes))
    store.put(b, payload(b, LAYOUT.block_bytes))      # a goes to disk
    assert store.stats().tier("disk").info["io"].startswith("buffered")
    loaded, out = read(store, a)
    assert loaded == 4 and torch.equal(out, payload(a, LAYOUT.block_bytes))
    store.close()


WRITER = r'''
import sys, time, torch, kvtier
sys.path.insert(0, {repo!r})
from tests.conftest import payload
layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
store = kvtier.Store(layout, [kvtier.HostTier(blocks=8), kvtier.DiskTier({path!r}, blocks=1024)],
                     kvtier.Namespace("disk-test", "r1"), write_through={wt})
for i in range({start}, {start} + 40):   # the disk holds every round's blocks: nothing is evicted
    keys = store.keys([i] * 32)
    store.put(keys, payload(keys, layout.block_bytes))
    if i % 3 == 0:
        store.flush()
        print(i, flush=True)              # every put up to i is durable now
time.sleep(60)
'''


@pytest.mark.parametrize("write_through", [False, True])
def test_kill_9_mid_stream_loses_nothing_flushed(tmp_path, write_through):
    path = tmp_path / "kv"
    start = 0
    for round_ in range(4):
        code = WRITER.format(repo=str(REPO), path=str(path), wt=write_through, start=start)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        flushed = []
        deadline = time.monotonic() + 60
        while len(flushed) < 3 + 2 * round_ and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            flushed.append(int(line))
        time.sleep(0.002 * round_)      # land the kill at different points of a put
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert flushed, "the writer never flushed"
        store = open_store(path, host=8, disk=1024)
        # Every chain put before the last completed flush reads back exactly ...
        for i in range(0 if round_ == 0 else start, flushed[-1] + 1):
            keys = store.keys([i] * 32)
            assert store.lookup(keys).blocks == 4, f"chain {i} was flushed but is gone"
            loaded, out = read(store, keys)
            assert loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
        # ... and whatever else survived is either exact or a counted miss, never wrong bytes.
        for i in range(flushed[-1] + 1, start + 40):
            keys = store.keys([i] * 32)
            n = store.lookup(keys).blocks
            loaded, out = read(store, keys[:n])
            assert torch.equal(out[:loaded], payload(keys[:loaded], LAYOUT.block_bytes))
        store.close()
        start += 40


def test_kvtier_inspect_reports_and_verifies(tmp_path):
    import json
    store = open_store(tmp_path / "kv")
    cs = chains(store, 3)
    for k in cs:
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.close()
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtier.cli", "inspect", str(tmp_path / "kv"), *a],
                                    capture_output=True, text=True, timeout=120)
    r = run("--verify", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["blocks"], rep["capacity_blocks"], rep["corrupt_blocks"]) == (12, 64, 0)
    assert rep["namespace"]["model"] == "disk-test" and "MHA 2L" in rep["layout"]
    _, records = read_directory(tmp_path / "kv")
    slot = records[0][1][0]
    with open(tmp_path / "kv" / "slab.bin", "r+b") as f:    # damage one stored block
        f.seek(slot * 8192)
        f.write(b"\xff" * 16)
    rep = json.loads(run("--verify", "--json").stdout)
    assert rep["corrupt_blocks"] == 1
    assert "12 of 64" in run().stdout


def test_bench_tiers_disk_json(tmp_path):
    import json
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "tiers", "--tier", "disk", "--block-bytes", "1MiB",
                        "--total", "16MiB", "--repeat", "1", "--path", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["op"] for x in rows] == ["put", "get"]
    for x in rows:
        assert x["gbps"] > 0 and x["baseline_gbps"] > 0 and abs(x["ratio"] - x["gbps"] / x["baseline_gbps"]) < 1e-9
        assert x["ratio_low"] == x["ratio"] == x["ratio_high"]        # one round: its own ratio
    assert rows[1]["cold_pread_gbps"] > 0 and list(tmp_path.iterdir()) == []   # cleaned up
    assert rows[0]["checksum_floor"] > 0 and rows[1]["checksum_floor"] is None   # raw writes with xxh3 beside them


def test_a_block_cascading_through_three_tiers_keeps_its_bytes(tmp_path):
    """One put can move a block two tiers down; each move must see the bytes of the one before."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=2, name="a"), kvtier.HostTier(blocks=1, name="b"),
                                  kvtier.DiskTier(tmp_path / "kv", blocks=16, name="c")], NS, promote=False)
    chains_ = [store.keys([i] * 16) for i in range(6)]   # 2 blocks each
    for k in chains_:
        store.put(k, payload(k, LAYOUT.block_bytes))
    for k in chains_:
        n = store.lookup(k).blocks
        loaded, out = read(store, k[:n])
        assert loaded == n and torch.equal(out, payload(k[:n], LAYOUT.block_bytes))
    assert store.stats().tier("c").used_blocks >= 8
    store.close()


class FailingTier(kvtier.HostTier):
    """A lower tier whose writes fail while `broken` is set."""
    broken = False

    def write(self, slots, rows, idx=None, keys=None):
        if self.broken:
            raise OSError(5, "Input/output error")
        super().write(slots, rows, idx, keys)


def test_a_failed_demotion_drops_the_evicted_blocks_and_the_put_goes_on(caplog):
    """A lower tier whose writes fail (a full or failing disk): the blocks being evicted into
    it are dropped and the put stores its own. The put failed instead, and with it every
    engine request that needed a page for as long as the disk failed."""
    low = FailingTier(blocks=8, name="low")
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=2, name="top"), low], NS)
    a, b, c = store.keys([1] * 16), store.keys([2] * 16), store.keys([3] * 16)
    store.put(a, payload(a, LAYOUT.block_bytes))
    low.broken = True
    t = store.put(b, payload(b, LAYOUT.block_bytes))      # must demote a: the write fails
    assert t.blocks == 2 and store.lookup(b).blocks == 2
    assert store.lookup(a).blocks == 0                     # dropped, not listed in a slot without it
    assert store.stats().tier("low").used_blocks == 0       # its slots hold no block: none is listed
    loaded, out = read(store, b)
    assert loaded == 2 and torch.equal(out, payload(b, LAYOUT.block_bytes))
    assert "dropped 2 block(s)" in caplog.text and caplog.text.count("moving evicted blocks down failed") == 1
    store.put(c, payload(c, LAYOUT.block_bytes))           # fails again: logged once a minute at most
    assert caplog.text.count("moving evicted blocks down failed") == 1
    low.broken = False
    store.put(a, payload(a, LAYOUT.block_bytes))           # demotes c: the lower tier works again
    assert store.lookup(c).by_tier() == {"top": 0, "low": 2}
    assert [t.used_blocks for t in store.stats().tiers] == [2, 2]
    loaded, out = read(store, c)
    assert loaded == 2 and torch.equal(out, payload(c, LAYOUT.block_bytes))
    assert all(e.refs == 0 for e in store.index.entries.values())


def test_a_copy_is_reserved_once_however_many_threads_ask(tmp_path):
    store = open_store(tmp_path / "kv", host=4)
    a, b = chains(store, 2)
    store.put(a, payload(a, LAYOUT.block_bytes))
    store.put(b, payload(b, LAYOUT.block_bytes))           # a is on disk now
    first = store.index.reserve_copies(a, 0)
    second = store.index.reserve_copies(a, 0)              # as a concurrent promotion would
    assert len(first.keys) == 4 and second.keys == [] and second.present == 4
    store.index.commit(first)
    store.index.commit(second)
    e = store.index.entries[a[0]]
    assert e.tier == 0 and set(e.copies) == {1}
    store.close()


def test_flush_while_other_threads_put(tmp_path):
    import threading
    store = open_store(tmp_path / "kv", host=8, disk=64, write_through=True)
    errors = []

    def flusher():
        for _ in range(30):
            try:
                store.flush()
            except Exception as e:   # noqa: BLE001 - any error is a failure here
                errors.append(e)

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(60):
        k = store.keys([i] * 32)
        store.put(k, payload(k, LAYOUT.block_bytes))
    t.join()
    store.close()
    assert not errors
    _, records = read_directory(tmp_path / "kv")
    assert len(records) <= 64                              # no delete was lost


def test_a_flush_never_holds_all_of_a_small_tier(tmp_path, monkeypatch):
    """A flush writes down in parts and holds a part's blocks while it is written: a part
    of 64 MiB was the whole of an 8-block host tier, so a put meanwhile stored nothing
    (`stored 0 rejected 4`). A part is at most a quarter of the smallest tier above."""
    import threading

    import kvtier.tiers.disk as disk

    store = open_store(tmp_path / "kv", host=8, disk=64)
    a = store.keys(list(range(8 * LAYOUT.block_tokens)))
    assert store.put(a, payload(a, LAYOUT.block_bytes)).blocks == 8
    real, writing, go = disk._pwritev_all, threading.Event(), threading.Event()

    def slow(fd, bufs, off):                 # the flush's first part is on its way meanwhile
        writing.set()
        go.wait(10)
        return real(fd, bufs, off)
    monkeypatch.setattr(disk, "_pwritev_all", slow)
    flush = threading.Thread(target=store.flush)
    flush.start()
    assert writing.wait(10)
    b = store.keys([7] * (4 * LAYOUT.block_tokens))
    threading.Timer(0.3, go.set).start()     # the disk goes on (the put's evictions write down too)
    done = store.put(b, payload(b, LAYOUT.block_bytes))
    flush.join(30)
    assert (done.blocks, done.rejected) == (4, 0)
    store.close()


def test_a_disk_tier_smaller_than_a_prefix_keeps_its_roots_run_after_run(tmp_path):
    """A 5-block disk under a 14-block prompt: each close wrote the prompt's uncached tail
    over the roots it had just been hit through, so restarts hit and missed in turn (an
    engine's cached tokens 0, 80, 0, 80). A flush writes down only what ranks within the
    tier's capacity among the blocks above (before: no restart hit at all here)."""
    hits = []
    for _ in range(4):
        store = open_store(tmp_path / "kv", host=16, disk=5)
        keys = store.keys(list(range(14 * LAYOUT.block_tokens)))
        n = store.lookup(keys).blocks
        hits.append(n)
        if n:
            out = torch.empty(n, LAYOUT.block_bytes, dtype=torch.uint8)
            assert store.get(keys[:n], out).loaded == n and torch.equal(out, payload(keys[:n], LAYOUT.block_bytes))
        store.put(keys[n:], payload(keys, LAYOUT.block_bytes)[n:])
        store.close()
    assert hits == [0, 5, 5, 5], hits


def test_a_damaged_index_is_forgotten_not_trusted(tmp_path):
    import lmdb
    store = open_store(tmp_path / "kv")
    a, b = chains(store, 2)
    for k in (a, b):
        store.put(k, payload(k, LAYOUT.block_bytes))
    store.close()
    env = lmdb.open(str(tmp_path / "kv" / "index.lmdb"), max_dbs=4)
    with env.begin(db=env.open_db(b"blocks"), write=True) as txn:     # one record turned to garbage
        txn.put(a[1], b"\xc1\xc1 not msgpack")
    env.close()
    again = open_store(tmp_path / "kv")
    assert again.lookup(a).blocks == 1 and again.lookup(b).blocks == 4
    loaded, out = read(again, b)
    assert loaded == 4 and torch.equal(out, payload(b, LAYOUT.block_bytes))
    again.close()
    data = tmp_path / "kv" / "index.lmdb" / "data.mdb"
    data.write_bytes(os.urandom(data.stat().st_size))                # the whole index destroyed
    third = open_store(tmp_path / "kv")
    assert third.stats().recovered_blocks == 0 and third.lookup(b).blocks == 0
    assert any(p.name.startswith("index.lmdb.damaged-") for p in (tmp_path / "kv").iterdir())
    third.put(b, payload(b, LAYOUT.block_bytes))                     # and it works from there
    assert read(third, b)[0] == 4
    third.close()


def test_a_kill_inside_the_index_rewrite_loses_nothing(tmp_path):
    """A short index is rewritten compact and swapped in by two renames; killed between them,
    only index.lmdb.short (the old, whole index) is there: the next open takes it back."""
    store = open_store(tmp_path / "kv")
    a = store.keys(list(range(4 * LAYOUT.block_tokens)))
    store.put(a, payload(a, LAYOUT.block_bytes))
    store.close()
    (tmp_path / "kv" / "index.lmdb").rename(tmp_path / "kv" / "index.lmdb.short")
    store = open_store(tmp_path / "kv")
    assert read(store, a)[0] == 4
    store.close()


def test_a_slab_larger_than_the_free_space_is_refused_before_it_fills_the_disk(tmp_path):
    import shutil
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(CapacityError, match=r"not enough free space .* is free\. Free some space or give the tier less"):
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv", capacity=free + (1 << 30))], NS)
    assert not (tmp_path / "kv").exists()        # refused before anything is created
    open_store(tmp_path / "kv").close()          # a tier that fits is made there
    with pytest.raises(CapacityError, match="not enough free space"):   # an existing tier, grown past the disk
        kvtier.Store(LAYOUT, [kvtier.DiskTier(tmp_path / "kv", capacity=free + (1 << 30))], NS)
    assert (tmp_path / "kv" / "slab.bin").stat().st_size == 64 * LAYOUT.block_bytes   # left as it was


def test_an_allocation_that_runs_out_of_space_part_way_gives_the_space_back(tmp_path, monkeypatch):
    import errno

    def runs_out(fd, offset, length):          # what a full disk does: some of it, then ENOSPC
        os.ftruncate(fd, length // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", runs_out)
    with pytest.raises(CapacityError, match="free space"):
        open_store(tmp_path / "kv")
    assert (tmp_path / "kv" / "slab.bin").stat().st_size == 0
    monkeypatch.undo()
    open_store(tmp_path / "kv").close()         # nothing is left locked


class FailingDisk(kvtier.DiskTier):
    """A disk tier whose I/O fails in the write whose first block is block `fail_at` of the
    put (one part of a pipelined put), on its I/O thread, as a failing device would."""
    fail_at = -1

    def _write_run(self, js, s0, rows, order):
        if min(order) == self.fail_at:
            raise OSError(5, "Input/output error: injected")
        return super()._write_run(js, s0, rows, order)


@pytest.mark.parametrize("fail", ["tail", "middle", "head", "none"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_pipelined_put_becomes_readable_whole_or_not_at_all(tmp_path, monkeypatch, fail, blocking):
    """A large put reserves and writes its tail part while the rest is reserved, then the
    middle and the head apart (store.py, put_cuts; PIPELINE_HEAD_BYTES shrunk here to 2
    blocks): if any part's write fails, no block of the put is readable, every slot is free
    again and the disk keeps no record of them."""
    monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", 2 * LAYOUT.block_bytes)
    assert kvtier.store.put_cuts(6, 2) == [(4, 6), (2, 4), (0, 2)]
    disk = FailingDisk(tmp_path / "kv", blocks=16)
    disk.fail_at = {"tail": 4, "middle": 2, "head": 0, "none": -1}[fail]
    store = kvtier.Store(LAYOUT, [disk], NS)
    keys = store.keys(list(range(6 * LAYOUT.block_tokens)))
    if fail == "none":
        t = store.put(keys, payload(keys, LAYOUT.block_bytes), blocking=blocking).wait()
        assert t.blocks == 6 and store.counters.puts == 1
        loaded, out = read(store, keys)
        assert loaded == 6 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
        store.close()
        return
    with pytest.raises(kvtier.TransferError, match="injected"):
        store.put(keys, payload(keys, LAYOUT.block_bytes), blocking=blocking).wait()
    assert store.lookup(keys).blocks == 0 and store.index.tiers[0].used == 0
    assert disk._records == {} and store.index.entries == {}
    disk.fail_at = -1
    assert store.put(keys, payload(keys, LAYOUT.block_bytes)).blocks == 6      # nothing is stuck
    loaded, out = read(store, keys)
    assert loaded == 6 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    store.close()


def test_a_begun_write_is_recorded_only_once_waited_for(tmp_path):
    """begin_write starts the bytes on the I/O threads and returns; the blocks' records (what a
    restart trusts) are committed by wait(), after every byte landed, and then read back exact."""
    import numpy as np

    disk = kvtier.DiskTier(tmp_path / "kv", blocks=40)
    disk.bind(8192)
    rows = np.random.default_rng(1).integers(0, 256, (40, 8192), dtype=np.uint8)
    keys = [os.urandom(16) for _ in range(40)]
    slots = list(range(39, -1, -1))
    pending = disk.begin_write(slots, rows, keys=keys)
    assert disk._records == {}
    pending.wait()
    assert {s: k for s, (k, _) in disk._records.items()} == dict(zip(slots, keys))
    out = np.zeros_like(rows)
    assert disk.read(slots, out, keys=keys) == []
    assert np.array_equal(out, rows)
    disk.close()


class FullIndexEnv:
    """An LMDB environment on a filesystem that filled up: a write transaction fails as LMDB's
    does there (mdb_txn_commit: No space left on device); reads and everything else pass."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def begin(self, *a, write=False, **kw):
        txn = self._env.begin(*a, write=write, **kw)
        if not write:
            return txn

        class Failing:
            def __enter__(self_):
                return txn.__enter__()

            def __exit__(self_, *exc):
                txn.abort()
                raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return Failing()


@pytest.mark.parametrize("write_through", [True, False])
def test_a_full_filesystem_is_a_kvtier_error_that_says_so(tmp_path, write_through):
    """With the slab preallocated only index.lmdb grows, and on a full filesystem its commit
    fails: put, flush and close raised lmdb.DiskError (`kvtier node`: "unexpected DiskError
    ... please report it"). Now a kvtier error that names the cause, and the tier is whole
    again once there is room."""
    path = tmp_path / "kv"
    store = open_store(path, host=4, disk=64, write_through=write_through)
    a, b = chains(store, 2)
    store.put(a, payload(a, LAYOUT.block_bytes))
    store.flush()
    disk = store.tiers[1]
    real = disk._env
    disk._env = FullIndexEnv(real)
    with pytest.raises(kvtier.KvtierError, match="is full: its index cannot grow .*free some space") as e:
        store.put(b, payload(b, LAYOUT.block_bytes))     # written through, or a's demotion
        store.flush()
    assert not isinstance(e.value, lmdb.Error)
    disk._env = real                                     # room again
    store.put(b, payload(b, LAYOUT.block_bytes))
    store.close()
    store = open_store(path, host=4, disk=64)
    for keys in (a, b):
        loaded, out = read(store, keys)
        assert torch.equal(out[:loaded], payload(keys[:loaded], LAYOUT.block_bytes))
    assert read(store, b)[0] == 4                        # the put after the failure is on disk
    store.close()


def test_a_full_filesystem_at_open_is_a_capacity_error(tmp_path, monkeypatch):
    """Opening an existing tier at another size writes its meta record: on a full filesystem
    that raised lmdb.DiskError; now a CapacityError (`kvtier: error: ...`), the lock let go."""
    open_store(tmp_path / "kv", disk=64).close()
    real = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda *a, **kw: FullIndexEnv(real(*a, **kw)))
    with pytest.raises(CapacityError, match="is full: its index cannot grow"):
        open_store(tmp_path / "kv", disk=32)
    monkeypatch.undo()
    open_store(tmp_path / "kv", disk=32).close()


@settings(max_examples=60, deadline=None)
@given(caps=hs.tuples(hs.integers(2, 6), hs.integers(2, 6), hs.integers(2, 6)),
       ops=hs.lists(hs.tuples(hs.integers(1, 11), hs.integers(1, 4), hs.booleans(), hs.booleans(), hs.booleans()),
                    min_size=1, max_size=30))
def test_failing_lower_tiers_never_fail_a_put_nor_break_the_index(caps, ops):
    """Puts while the middle and bottom tiers' writes fail at random (a block may be demoted
    twice in one put): no put fails, every readable block holds its bytes, each tier's copies
    are its used slots, and what left a tier entered the next one or was dropped."""
    mid, low = FailingTier(blocks=caps[1], name="mid"), FailingTier(blocks=caps[2], name="low")
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=caps[0], name="top"), mid, low], NS)
    for seed, blocks, mid_broken, low_broken, get in ops:
        keys = store.keys([seed] * 4 * min(blocks, caps[0]))
        if get:
            n = store.lookup(keys).blocks
            loaded, out = read(store, keys[:n])
            assert loaded == n and torch.equal(out, payload(keys[:n], LAYOUT.block_bytes))
            continue
        mid.broken, low.broken = mid_broken, low_broken
        store.put(keys, payload(keys, LAYOUT.block_bytes))
        mid.broken = low.broken = False
        s = store.stats()
        for t in s.tiers:
            assert t.inserted + t.demoted_in - t.evicted == t.used_blocks
        for upper, lower in zip(s.tiers, s.tiers[1:]):
            assert upper.evicted == lower.demoted_in + upper.dropped
        assert s.tiers[-1].evicted == s.tiers[-1].dropped
        copies = [0, 0, 0]
        for e in store.index.entries.values():
            for t in [e.tier, *(e.copies or {})]:
                copies[t] += 1
        assert copies == [t.used_blocks for t in s.tiers]
    store.close()
