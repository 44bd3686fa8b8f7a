"""kvtier._mla, the C kernel of MLA's absorbed attention over the paged pool, against torch.

The model's oracle tests (tests/test_engine_model.py) run it inside the engine against
transformers; here it is checked alone on awkward sizes (head counts not a multiple of its
group of 4, widths and ranks with tails, key counts across its 32-key blocks, a causal
length per query), for its input checks, and inside the model against the torch path it
replaces, with one thread and with the queries split over two.
"""
from __future__ import annotations

import pytest
import torch

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.model import DeepseekV3, mla
from kvtier.engine.config import preset
from kvtier.engine.weights import random_weights

kernel = pytest.importorskip("kvtier._mla")


def reference(q, pool, rows, lens, offset, scale, rank):
    """softmax(scale * q . row) @ row[:rank] over each query's first lens[n] rows, in float64."""
    out = torch.empty(q.shape[0], q.shape[1], rank, dtype=torch.float64)
    for n in range(q.shape[0]):
        keys = pool[rows[n, :lens[n]] + offset].double()                   # [len, width]
        p = torch.softmax(scale * q[n].double() @ keys.T, dim=-1)
        out[n] = p @ keys[:, :rank]
    return out


@pytest.mark.parametrize("heads, width, rank", [(4, 576, 512), (5, 27, 20), (1, 40, 32), (9, 72, 64)])
def test_kernel_matches_softmax_attention(heads, width, rank):
    g = torch.Generator().manual_seed(heads)
    pool = torch.randn(300, width, generator=g)
    n, k = 6, 70                                       # 70 keys: blocks of 32, 32 and 6
    rows = torch.randint(0, 280, (n, k), generator=g)
    lens = torch.tensor([1, 31, 32, 33, 64, 70])
    q = torch.randn(n, heads, width, generator=g) * 0.3
    out = torch.full((n, heads, rank), float("nan"))
    kernel.attend(out.numpy(), q.numpy(), pool.view(-1).numpy(), rows.numpy(), lens.numpy(), 20, heads, width,
                  rank, 0.7)
    ref = reference(q, pool, rows, lens, 20, 0.7, rank)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (out[0].double() - pool[rows[0, 0] + 20, :rank].double()).abs().max() < 1e-6   # one key: that row


def test_kernel_checks_its_inputs_before_reading():
    pool = torch.randn(50, 8)
    q, out = torch.randn(2, 1, 8), torch.zeros(2, 1, 4)
    rows, lens = torch.tensor([[0, 1, 2], [3, 4, 49]]), torch.tensor([3, 3])
    args = lambda **kw: dict(dict(out=out.numpy(), q=q.numpy(), pool=pool.view(-1).numpy(), rows=rows.numpy(),
                                  lens=lens.numpy(), offset=0, heads=1, width=8, rank=4, scale=1.0), **kw)
    call = lambda a: kernel.attend(*a.values())
    call(args())
    assert out.abs().sum() > 0
    out.zero_()
    with pytest.raises(ValueError, match="outside the pool"):
        call(args(offset=1))                                              # 49 + 1 is past the pool
    with pytest.raises(ValueError, match="lens"):
        call(args(lens=torch.tensor([3, 4]).numpy()))                     # more keys than rows
    with pytest.raises(ValueError, match="lens"):
        call(args(lens=torch.tensor([0, 3]).numpy()))
    with pytest.raises(ValueError, match="sizes"):
        call(args(rank=5))                                                # out is [2, 1, 4]
    assert out.abs().sum() == 0                                           # nothing was written


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lengths", [[(37, 1), (70, 1), (5, 1), (50, 1)],      # decodes of different lengths
                                     [(40, 1), (40, 1)],                        # equal lengths: no mask
                                     [(37, 1), (50, 3)]])                       # a chunk: the torch path
def test_model_with_kernel_equals_torch_path(threads, lengths, monkeypatch):
    """A step of decodes (one query per sequence, absorbed) gives the same logits with the
    kernel as with torch's gather + matmuls; a step where a sequence has several queries
    does not use the kernel."""
    config = preset("kimi-tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, random_weights(config, seed=3, std=0.15), dtype=torch.float32)
    bt = 16
    pool = torch.randn(40, *model.kv_layout(bt).block_shape) * 0.5
    ids, pos, seqs, page = [], [], [], 0
    for ctx, new in lengths:                                           # (context, new tokens)
        npages = -(-(ctx + new) // bt)
        seqs.append(SeqSlice(len(ids), new, ctx, torch.arange(page, page + npages).flip(0)))
        page += npages
        ids += [(7 * ctx + i) % 256 for i in range(new)]
        pos += range(ctx, ctx + new)
    calls = []
    monkeypatch.setattr(mla, "_paged_attend", lambda *a: (calls.append(a[5]), kernel.attend(*a)))

    def run(paged: bool) -> torch.Tensor:
        monkeypatch.setattr(mla, "PAGED_KERNEL", paged)
        batch = StepBatch(torch.tensor(ids), torch.tensor(pos), seqs, torch.arange(len(ids)))
        return model(batch, pool.clone())

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monkeypatch.setattr(mla, "FORCE_FORM", "absorbed")
        ours, ref = run(True), run(False)
    finally:
        torch.set_num_threads(before)
    one_query = all(new == 1 for _, new in lengths)
    assert sorted(set(calls)) == ([0, bt] if one_query else [])      # layer 0 and 1's row offsets
    assert ref.std() > 0.3
    assert (ours - ref).abs().max() < 1e-4                # fp32 sums in another order
