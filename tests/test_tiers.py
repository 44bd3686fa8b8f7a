"""Host tier: slots hold exactly the bytes written, however the copies are merged."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import CapacityError, ConfigError
from kvtier.tiers import HostTier
from kvtier.tiers.base import copy_runs

BB = 64


@st.composite
def slot_maps(draw):
    cap = draw(st.integers(1, 24))
    n = draw(st.integers(0, cap))
    slots = draw(st.permutations(range(cap)))[:n]
    # Runs are common in practice: sometimes make them on purpose.
    if draw(st.booleans()) and n:
        start = draw(st.integers(0, cap - n))
        step = draw(st.sampled_from([1, -1]))
        slots = list(range(start, start + n))[::step]
    idx = draw(st.one_of(st.none(), st.permutations(range(n))))
    return cap, list(slots), idx


@given(slot_maps(), st.booleans())
@settings(max_examples=300)
def test_write_then_read_matches_a_row_by_row_copy(m, as_list):
    cap, slots, idx = m
    n = len(slots)
    tier = HostTier(blocks=cap)
    tier.bind(BB)
    src = np.random.default_rng(n).integers(0, 256, (n, BB), dtype=np.uint8)
    rows = list(src) if as_list else src
    tier.write(slots, rows, idx)
    order = range(n) if idx is None else idx
    for s, i in zip(slots, order):
        assert np.array_equal(tier.block(s), src[i])
    out = np.zeros_like(src)
    tier.read(slots, list(out) if as_list else out, idx)
    assert np.array_equal(out, src)


@given(slot_maps())
def test_copy_runs_cover_every_pair_once(m):
    _, slots, idx = m
    order = list(range(len(slots))) if idx is None else list(idx)
    pairs = sorted((s + k, i + k) for s, i, n in copy_runs(slots, idx, True) for k in range(n))
    assert pairs == sorted(zip(slots, order))


def test_tier_sizes_and_memory_report():
    t = HostTier(capacity="1MiB")
    assert t.bind(1000) == 1048
    info = t.info()
    assert info["memory"] in ("pinned", "pageable") and info["allocated_bytes"] >= 1048 * 1000
    with pytest.raises(ConfigError, match="already in use"):
        t.bind(1000)
    with pytest.raises(CapacityError, match="smaller than one block"):
        HostTier(capacity="1KiB").bind(4096)
    with pytest.raises(ConfigError, match="positive int"):
        HostTier(blocks=0)
    t.close()


def test_a_host_tier_larger_than_memory_says_how_much_there_is():
    from kvtier.tiers.memory import memory_available

    avail, total = memory_available()
    assert avail is not None and total is not None and 0 < avail <= total
    for t in (HostTier(capacity=4 * total), HostTier(capacity=999999999999999)):
        with pytest.raises(ConfigError, match=r"host memory \(tier 'host'\): .* asked for, but this machine has "
                                              r".* of memory available .*Give the tier a smaller capacity"):
            t.bind(4096)
        assert t.info() == {"memory": "unallocated"}


def test_tiers_that_fit_only_alone_are_refused_before_any_is_allocated(ns):
    """Each tier was checked as it was allocated: a device tier (and its memory touched) came
    before a host tier too large for what was left; two host tiers each under the free memory
    passed together."""
    import torch

    import kvtier
    from kvtier.tiers import DeviceTier
    from kvtier.tiers.memory import memory_available

    avail = memory_available()[0]
    layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)
    for tiers, match in (
            ([DeviceTier(blocks=4, device="cpu"), HostTier(capacity=4 * avail)], r"tiers 'device', 'host': "),
            ([HostTier(capacity=avail * 2 // 3, name="a"), HostTier(capacity=avail * 2 // 3, name="b")],
             r"tiers 'a', 'b': .* \+ ")):
        with pytest.raises(ConfigError, match=r"CPU memory \(" + match + r".* asked for, but this machine has"):
            kvtier.Store(layout, tiers, ns)
        assert all(t.block_bytes == 0 and getattr(t, "tensor", None) is None and getattr(t, "slots", None) is None
                   for t in tiers)


def test_a_refused_mapping_is_the_same_clear_error(monkeypatch):
    """Where the free-memory check passes but the kernel still refuses the mapping (ENOMEM)."""
    import errno

    import kvtier.tiers.memory as memory

    def refuse(*a, **k):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(memory, "memory_available", lambda: (None, None))
    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    with pytest.raises(ConfigError, match="asked for, but the machine could not provide it.*smaller capacity"):
        HostTier(capacity="1MiB", pin=False).bind(4096)


def test_a_device_tier_on_the_cpu_larger_than_memory():
    import torch

    from kvtier.tiers import DeviceTier
    from kvtier.tiers.memory import memory_available

    t = DeviceTier(capacity=4 * memory_available()[1], device="cpu")
    with pytest.raises(ConfigError, match=r"CPU memory \(device tier 'device'\): .* asked for.*smaller capacity"):
        t.bind(4096)
    small = DeviceTier(blocks=4, device="cpu")
    small.bind(4096)
    assert small.info()["prefault_s"] >= 0 and torch.count_nonzero(small.tensor) == 0


def test_kvtier_demo_with_more_host_memory_than_the_machine_has():
    from tests.conftest import assert_one_line_error, run_kvtier

    for capacity in ("100TiB", "999999999999999"):
        r = run_kvtier("demo", "--capacity", capacity)
        assert_one_line_error(r, 2, "asked for", "memory available", "smaller capacity")


def test_a_large_host_tier_reports_its_prefault(monkeypatch, caplog):
    """Above SHOW_PREFAULT the tier logs that it prefaults, advances a progress bar per chunk
    (every byte once), and its stats say how long it took."""
    from contextlib import contextmanager

    import kvtier.tiers.memory as memory

    shown = []

    @contextmanager
    def bar(description, total):
        shown.append([description, total, []])
        yield type("Bar", (), {"advance": lambda self, n: shown[-1][2].append(n)})()

    monkeypatch.setattr(memory, "SHOW_PREFAULT", 1 << 20)
    monkeypatch.setattr(memory, "PREFAULT_CHUNK", 192 << 10)
    monkeypatch.setattr(memory, "progress", bar)
    caplog.set_level("INFO", logger="kvtier.tiers")
    t = HostTier(capacity="1MiB", pin=False, name="warm")
    t.bind(4096)
    (description, total, steps), = shown
    assert description == "prefaulting 1.00 MiB of host memory (tier 'warm')" and total == 1 << 20
    assert sum(steps) == total and len(steps) == -(-total // (192 << 10))
    assert "prefaulting 1.00 MiB of host memory (tier 'warm')" in caplog.text
    assert "prefaulted 1.00 MiB" in caplog.text
    assert t.info()["prefault_s"] >= 0 and not t.slots.any()
    shown.clear()
    small = HostTier(capacity="512KiB", pin=False)
    small.bind(4096)
    assert shown == [] and "prefault_s" in small.info()       # small tiers: no bar, no log line
    t.close()
    small.close()


@pytest.mark.parametrize("on_a_thread", [True, False])
def test_a_memory_tier_begins_a_write_on_the_executor_given_or_here(on_a_thread):
    from concurrent.futures import ThreadPoolExecutor

    tier = HostTier(blocks=8)
    tier.bind(BB)
    src = np.random.default_rng(2).integers(0, 256, (8, BB), dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        pending = tier.begin_write(list(range(8)), src, executor=pool if on_a_thread else None)
        pending.wait()
    assert np.array_equal(tier.slots, src)
