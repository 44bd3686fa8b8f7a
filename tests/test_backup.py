"""Backups (kvtier/backup.py): blocks an engine caches in its pages get a copy one tier down
in the background, so evicting them later moves no bytes; an allocation never fails because
a backup pass holds blocks; closing stops it."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

import kvtier
import kvtier.backup
from kvtier.adapter import KVAdapter

LAYOUT = kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=16, rope_dim=8, block_tokens=4, dtype=torch.float32)
NS = kvtier.Namespace(model="backup-test", revision="r1")


CUDA = torch.cuda.is_available()
ON_A_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")])


def make(backup: bool = True, device_blocks: int = 8, host_blocks: int = 32, disk=None, device: str = "cpu") -> KVAdapter:
    tiers: list = [kvtier.DeviceTier(blocks=device_blocks, device=device), kvtier.HostTier(blocks=host_blocks)]
    if disk is not None:
        tiers.append(kvtier.DiskTier(disk, blocks=32))
    return KVAdapter(kvtier.Store(LAYOUT, tiers, NS, promote=False, backup=backup))


def compute(a: KVAdapter, first_token: int, blocks: int, tag: float) -> tuple[list[bytes], list[int], list[torch.Tensor]]:
    """A request's blocks computed into fresh pages and cached (what the engine's step does)."""
    keys = a.keys(list(range(first_token, first_token + blocks * LAYOUT.block_tokens)))
    pages = a.allocate(len(keys))
    assert pages is not None
    data = []
    for j, p in enumerate(pages):
        a.pool()[p] = torch.full(LAYOUT.block_shape, tag + j)
        data.append(a.pool()[p].clone())
    assert a.cache(keys, pages) == len(keys)
    return list(keys), pages, data


@pytest.mark.parametrize("device", ["cpu", ON_A_GPU])
@pytest.mark.parametrize("backup", [True, False])
def test_a_backed_up_block_leaves_the_pages_without_a_copy(backup, device):
    """With a backup, a block the engine cached has a host copy soon after, and its eviction
    from the pages moves no bytes (a drop); without one, the eviction demotes it. Either
    way its bytes are in host memory afterwards. On a GPU the backup's copy runs on the
    device tier's own stream, from the backup's thread."""
    a = make(backup=backup, device=device)
    st = a.store
    keys, pages, data = compute(a, 0, 6, 10.0)
    a.free(pages)
    if backup:
        assert st.backup.drain(timeout=10)
        assert st.backup.copied == 6
        assert all(st.index.entries[k].slot_in(1) is not None for k in keys)   # a copy in host, before any eviction
    demoted = st.stats().tier("host").demoted_in
    fresh = a.allocate(8)                              # every page: the 6 blocks leave the device tier
    assert fresh is not None
    assert st.stats().tier("host").demoted_in - demoted == (0 if backup else 6)
    assert a.lookup(list(range(24))).tiers == ["host"] * 6
    host = st.tiers[1].memory()
    for k, d in zip(keys, data):                       # the host copies hold the pages' bytes
        assert torch.equal(host[st.index.entries[k].slot], d.cpu().view(-1).view(torch.uint8))
    a.free(fresh)
    load = a.load(a.lookup(list(range(24))))
    load.wait()
    assert load.blocks == 6
    for p, d in zip(load.pages, data):
        assert torch.equal(a.pool()[p], d)
    a.free(load.pages)
    a.close()
    st.close()


def hold_the_next_pass(monkeypatch, st: kvtier.Store) -> tuple[threading.Event, threading.Event]:
    """The next backup pass blocks in its copy until `release` is set (`copying` says it got
    there, holding its blocks); the first caller that pauses the backup sets `release`, so an
    allocation that needs those blocks is what lets the pass finish."""
    host = st.tiers[1]
    copying, release = threading.Event(), threading.Event()
    write, paused = host.write, st.backup.paused

    def slow_write(*args, **kwargs):
        copying.set()
        assert release.wait(10), "nobody paused the backup"
        return write(*args, **kwargs)

    @contextmanager
    def pausing():
        release.set()
        with paused():
            yield
    monkeypatch.setattr(host, "write", slow_write)
    monkeypatch.setattr(st.backup, "paused", pausing)
    return copying, release


def test_an_allocation_waits_for_a_backup_pass_that_holds_the_pages_it_needs(monkeypatch):
    """A pass holds the blocks it copies (they cannot be evicted meanwhile). An allocation
    that needs them pauses the backup until the pass ends instead of failing."""
    a = make(device_blocks=4)
    st = a.store
    copying, release = hold_the_next_pass(monkeypatch, st)
    keys, pages, _ = compute(a, 0, 4, 1.0)            # the backup's pass starts, holding all 4
    a.free(pages)
    assert copying.wait(10) and st.backup.copying
    fresh = a.allocate(4)                              # needs all 4: pauses the backup, then drops them
    assert release.is_set()                            # it did pause
    assert fresh is not None and sorted(fresh) == sorted(pages)
    assert a.lookup(list(range(16))).tiers == ["host"] * 4    # backed up, then dropped from the device tier
    a.free(fresh)
    a.close()
    st.close()


def test_a_load_needing_pages_a_backup_pass_holds_gets_them(monkeypatch):
    """The same for a load from a lower tier (PagePool.plan allocates its pages under the lock)."""
    a = make(device_blocks=4)
    st = a.store
    old, old_pages, data = compute(a, 1000, 4, 5.0)
    a.free(old_pages)
    assert st.backup.drain(timeout=10)
    with st.backup.paused():                          # no pass starts before the slow write is in place
        _, pages, _ = compute(a, 0, 4, 1.0)           # evicts (drops) the old prompt: in host only now
        a.free(pages)
        copying, release = hold_the_next_pass(monkeypatch, st)
    assert copying.wait(10)                           # a pass over the new prompt's blocks, held
    load = a.load(a.lookup(list(range(1000, 1016))))
    assert release.is_set()
    load.wait()
    assert load.blocks == 4 and load.from_tiers == {"host": 4}
    for p, d in zip(load.pages, data):
        assert torch.equal(a.pool()[p], d)
    a.free(load.pages)
    a.close()
    st.close()


def test_a_block_demoted_before_its_pass_is_not_copied_back_up(tmp_path):
    """A backup only copies blocks still above its tier: one that went down to disk before
    its pass ran stays there (no promotion into host memory behind the store's back)."""
    a = make(device_blocks=8, host_blocks=4, disk=tmp_path / "kv")
    st = a.store
    with st.backup.paused():                          # both prompts wait for their pass
        keys, pages, _ = compute(a, 0, 4, 1.0)
        _, more, _ = compute(a, 500, 4, 2.0)
        a.free(pages + more)
        fresh = a.allocate(8)                         # the first prompt on to disk, the second to host
        assert a.lookup(list(range(16))).tiers == ["disk"] * 4
        assert a.lookup(list(range(500, 516))).tiers == ["host"] * 4
    assert st.backup.drain(timeout=10)
    assert st.backup.copied == 0
    assert a.lookup(list(range(16))).tiers == ["disk"] * 4
    a.free(fresh)
    a.close()
    st.close()


def test_backups_wait_in_a_bounded_queue():
    a = make(device_blocks=4)
    st = a.store
    backup = st.backup
    with backup.paused():                             # nothing is copied meanwhile
        keys, pages, _ = compute(a, 0, 4, 1.0)
        backup.submit([bytes([i]) * 16 for i in range(100)])   # more than the pages could ever hold
        assert len(backup._pending) == 4              # the pages' capacity: the oldest are not backed up
        assert backup.copied == 0
    a.free(pages)
    assert backup.drain(timeout=10)
    assert backup.copied == 0 and backup.failed == 0  # unknown keys are skipped, not errors
    a.close()
    st.close()


def test_close_ends_the_pass_in_progress_and_drops_the_rest(monkeypatch):
    a = make(device_blocks=8)
    st = a.store
    backup = st.backup
    host = st.tiers[1]
    copying, release = threading.Event(), threading.Event()
    write = host.write

    def slow_write(*args, **kwargs):
        copying.set()
        assert release.wait(10)
        return write(*args, **kwargs)
    monkeypatch.setattr(host, "write", slow_write)
    first, pages, _ = compute(a, 0, 2, 1.0)           # a pass over these two, blocked in its copy
    assert copying.wait(10)
    second, more, _ = compute(a, 100, 2, 2.0)         # waiting behind it
    assert len(backup._pending) == 2
    closer = threading.Thread(target=st.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                          # close waits for the pass in progress
    release.set()
    closer.join(10)
    assert not closer.is_alive()
    assert backup.copied == 2 and not backup._pending  # the second pair was never copied
    backup.submit(second)                             # ignored once closed
    assert not backup._pending
    a.close()


def test_the_thread_ends_when_idle_and_comes_back(monkeypatch):
    monkeypatch.setattr(kvtier.backup, "IDLE_EXIT_S", 0.05)
    a = make()
    st = a.store
    _, pages, _ = compute(a, 0, 2, 1.0)
    assert st.backup.drain(timeout=10)
    deadline = time.monotonic() + 10
    while st.backup._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.backup._thread is None                  # nothing keeps the store alive in the background
    _, more, _ = compute(a, 100, 2, 2.0)
    assert st.backup.drain(timeout=10) and st.backup.copied == 4
    a.free(pages + more)
    a.close()
    st.close()


def test_a_backup_to_disk_writes_the_blocks_before_their_eviction(tmp_path):
    """With the disk right below the pages, the backup is an early write-back to disk."""
    a = KVAdapter(kvtier.Store(LAYOUT, [kvtier.DeviceTier(blocks=4, device="cpu"), kvtier.DiskTier(tmp_path / "kv", blocks=16)],
                               NS, promote=False))
    st = a.store
    keys, pages, data = compute(a, 0, 4, 3.0)
    a.free(pages)
    assert st.backup.drain(timeout=10) and st.backup.copied == 4
    assert len(st.tiers[1].recover()) == 4            # on disk, with records
    a.close()
    st.close()


def test_backup_is_a_store_config_setting(tmp_path):
    assert kvtier.StoreConfig().backup == "auto"
    with pytest.raises(kvtier.ConfigError, match='backup must be true, false or "auto"'):
        kvtier.StoreConfig(backup="yes")
    with pytest.raises(kvtier.ConfigError, match="backup must be True, False or 'auto'"):
        kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS, backup=1)
    store = kvtier.StoreConfig(backup=False, host_capacity="1MiB").build(LAYOUT, NS, device="cpu")
    assert store.backup is None and store.stats().backup is None
    store.close()
    store = kvtier.StoreConfig(host_capacity="1MiB").build(LAYOUT, NS)   # one tier: nothing below to copy to
    assert store.backup is None
    store.close()


@pytest.mark.parametrize("host_blocks, setting, on", [
    (8, "auto", True), (12, "auto", True), (7, "auto", False), (4, "auto", False),
    (4, True, True), (16, False, False)])
def test_auto_backs_up_only_into_a_tier_twice_the_pages(host_blocks, setting, on):
    """Backup copies hold one slot below per block the pages hold: "auto" makes them only
    where the tier below has at least twice the pages' slots (a host tier the size of the
    pages kept far fewer distinct blocks with them: docs/serve.md)."""
    per_block = LAYOUT.block_bytes
    cfg = kvtier.StoreConfig(device_capacity=4 * per_block, host_capacity=host_blocks * per_block, backup=setting)
    store = cfg.build(LAYOUT, NS, device="cpu")
    assert (store.backup is not None) is on
    a = KVAdapter(store)
    _keys, pages, _ = compute(a, 0, 4, 1.0)
    a.free(pages)
    if on:
        assert store.backup.drain(timeout=10)
        assert store.stats().backup == {"tier": "host", "copied": 4, "failed": 0}
        assert store.index.tiers[1].used == 4          # the pages' blocks have copies below
    else:
        assert store.stats().backup is None and store.index.tiers[1].used == 0
    a.close()
    store.close()


@pytest.mark.parametrize("backup", [True, False])
def test_a_chain_lands_in_consecutive_host_slots_after_churn(backup):
    """A GPU load or backup moves one DMA per run of consecutive host slots, so a chain's
    copies one tier down should sit in consecutive slots in chain order; with the host tier
    full and evicting older chains (and, without backups, blocks demoted one victim at a
    time), each chain still lands in one run. (It fell apart into one run per block after a
    few chains: a kimi-tiny host hit on an H200 issued 239 copies for 254 blocks.)"""
    a = make(backup=backup, device_blocks=6, host_blocks=24)   # one chain: the next evicts it whole
    st = a.store
    chains = []
    for c in range(12):
        keys, pages, _ = compute(a, 1000 * c, 6, float(c))
        a.free(pages)
        chains.append(keys)
        if backup:
            assert st.backup.drain(timeout=10)
        if c < 2:
            continue
        before = chains[-2] if not backup else chains[-1]   # without backups a chain moves down when the next one evicts it
        slots = [st.index.entries[k].slot_in(1) for k in before]
        assert None not in slots
        assert slots == list(range(slots[0], slots[0] + len(slots))), (c, slots)
    assert st.stats().tiers[1].evicted > 0          # the host tier did churn
    a.store.close()


def test_a_backup_failing_every_pass_is_logged_once_a_minute_with_a_count(monkeypatch, caplog):
    """A cause that fails every pass (a full disk below the pages) wrote one warning per pass:
    an engine caching blocks all the time wrote them without bound. Now the first failure,
    then one per WARN_EVERY_S saying how many passes and blocks failed since."""
    clock = [1000.0]
    monkeypatch.setattr(kvtier.backup, "monotonic", lambda: clock[0])
    a = make(device_blocks=8)
    st = a.store
    host = st.tiers[1]

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(host, "write", full)
    with caplog.at_level("WARNING", logger="kvtier.backup"):
        for r in range(5):
            _, pages, _ = compute(a, 100 * r, 1, float(r))
            assert st.backup.drain(timeout=10)
            a.free(pages)
        assert st.backup.failed == 5
        assert len(caplog.records) == 1 and "No space left on device" in caplog.text
        clock[0] += kvtier.backup.WARN_EVERY_S
        _, pages, _ = compute(a, 1000, 1, 9.0)
        assert st.backup.drain(timeout=10)
        a.free(pages)
    assert len(caplog.records) == 2, caplog.text
    assert "(5 passes, 5 blocks since the last warning)" in caplog.records[1].getMessage()
    monkeypatch.undo()
    a.close()
    st.close()


def test_blocks_loaded_from_the_backups_tier_are_not_backed_up_again(monkeypatch):
    """A host hit's pages, cached again once loaded, were all handed to the backup, whose
    thread then found each already in host memory: Python beside the next steps for nothing."""
    a = make(device_blocks=8)
    st = a.store
    keys, pages, _ = compute(a, 0, 6, 10.0)
    a.free(pages)
    assert st.backup.drain(timeout=10) and st.backup.copied == 6
    a.free(a.allocate(8))                              # every page: the 6 blocks are in host memory only
    submitted: list[bytes] = []
    submit = st.backup.submit
    monkeypatch.setattr(st.backup, "submit", lambda ks: (submitted.extend(ks), submit(ks)))
    load = a.load(a.lookup(list(range(24))))
    load.wait()
    assert load.blocks == 6
    a.cache(keys, load.pages)                          # what the engine does with loaded pages
    more, more_pages, _ = compute(a, 100, 2, 20.0)     # newly computed blocks still are backed up
    assert submitted == more
    assert st.backup.drain(timeout=10) and st.backup.copied == 8
    a.free(load.pages + more_pages)
    a.close()
    st.close()
