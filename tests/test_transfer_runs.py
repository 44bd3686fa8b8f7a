"""Copies cut into runs of consecutive rows: how a save from GPU pages lands in the host
tier's slots (one DMA per run) and how held rows go up to a GPU. Checked on the CPU."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

import kvtier
from kvtier.transfer.runs import copy_rows, runs
from kvtier.transfer.streams import SaveHandle


def test_runs_join_rows_consecutive_on_both_sides():
    assert runs([0, 1, 2, 5, 6], [10, 11, 12, 3, 4]) == [(0, 10, 3), (5, 3, 2)]
    assert runs([2, 1, 0], [7, 6, 5]) == [(0, 5, 3)]            # a tail-first chain: one run
    assert runs([0, 1], [4, 3]) == [(0, 4, 1), (1, 3, 1)]
    assert runs([], []) == []


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(12))), st.integers(1, 12))
def test_copy_rows_moves_each_row_to_its_slot(perm, k):
    src = torch.arange(12 * 4, dtype=torch.uint8).view(12, 4)
    dst = torch.zeros(16, 4, dtype=torch.uint8)
    src_rows, dst_rows = list(range(k)), [p + 2 for p in perm[:k]]
    copy_rows(src, src_rows, dst, dst_rows)
    for s, d in zip(src_rows, dst_rows):
        assert torch.equal(dst[d], src[s])
    untouched = set(range(16)) - set(dst_rows)
    assert all(int(dst[u].sum()) == 0 for u in untouched)


def test_rows_from_a_device_are_written_in_place_into_reserved_slots():
    """The GPU save path after its gather (EnginePagesSave.wait with device rows: Store.write_in_place
    with SaveHandle.copy_to into reserved slots), run here with CPU rows, so by its
    one-copy-per-run fallback: blocks land in reserved host-tier slots, readable after,
    cached ones skipped."""
    layout = kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=8, rope_dim=8, block_tokens=4, dtype=torch.float32)
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=8)], kvtier.Namespace("runs", "r1"))
    keys = store.keys(list(range(16)))
    rows = torch.randint(0, 255, (4, layout.block_bytes), dtype=torch.uint8)
    store.put(keys[:1], rows[:1])
    saved = SaveHandle(rows, None, None, ())
    t = store.write_in_place(keys, lambda w: saved.copy_to(w.memory, w.positions, w.slots.tolist(), wait=False),
                             saved.wait_copies)
    assert (t.blocks, t.present) == (3, 1)
    out = torch.zeros_like(rows)
    assert store.get(keys, out).loaded == 4 and torch.equal(out, rows)
    store.close()
