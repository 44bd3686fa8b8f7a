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
