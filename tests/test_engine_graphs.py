"""Decode steps of static shape (kvtier.engine.graphs, kvtier.engine.batch.decode_batch): what
a CUDA graph captures, run eagerly on the CPU against the engine's usual step; and, on a
GPU, the captured graphs against eager decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvtier import StoreConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.batch import SeqSlice, StepBatch, decode_batch
from kvtier.engine.config import preset
from kvtier.engine.graphs import bucket_size
from kvtier.engine.model import DeepseekV3, load_model, mla, moe
from kvtier.engine.weights import random_weights
from kvtier.errors import ConfigError


@pytest.mark.parametrize("paged_kernel", [True, False])
def test_a_padded_decode_step_gives_the_steps_logits_and_writes_only_its_scratch_page(paged_kernel, monkeypatch):
    """Three decodes (contexts 37, 5, 70) padded to a batch of 4 and 8 pages: the same logits as
    the unpadded step, and the same pool but for the scratch page the padding row wrote."""
    monkeypatch.setattr(mla, "PAGED_KERNEL", paged_kernel)
    config = preset("kimi-tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, random_weights(config, seed=3, std=0.15), dtype=torch.float32)
    bt, scratch = 16, 39
    pool = torch.randn(40, *model.kv_layout(bt).block_shape) * 0.5
    contexts = [37, 5, 70]
    ids = [(7 * c) % 256 for c in contexts]
    pages, seqs, at = [], [], 0
    for i, ctx in enumerate(contexts):
        n = ctx // bt + 1
        pages.append(list(range(at + n - 1, at - 1, -1)))             # pages out of order
        seqs.append(SeqSlice(i, 1, ctx, torch.tensor(pages[-1])))
        at += n
    dynamic = pool.clone()
    want = model(StepBatch(torch.tensor(ids), torch.tensor(contexts), seqs, torch.arange(3)), dynamic)

    b, p = bucket_size(4), bucket_size(max(len(x) for x in pages) + 2)
    table = torch.full((b, p), scratch)
    for i, row in enumerate(pages):
        table[i, :len(row)] = torch.tensor(row)
    padded = pool.clone()
    got = model(decode_batch(torch.tensor(ids + [0]), torch.tensor(contexts + [0]), table, padded), padded)

    assert got.shape[0] == 4 and want.std() > 0.1
    assert (got[:3] - want).abs().max() < 1e-4
    assert (padded[:at] - dynamic[:at]).abs().max() < 1e-4            # the sequences' pages as the step wrote them
    assert torch.equal(padded[at:scratch], pool[at:scratch])           # pages no sequence has: untouched
    assert not torch.equal(padded[scratch], pool[scratch])             # the padding row wrote its page
    assert torch.equal(dynamic[scratch], pool[scratch])


class _NoHostReads(TorchFunctionMode):
    """Fails any torch call that reads a tensor back to the host (what a CUDA graph cannot
    capture): on a CPU, the same calls a GPU would sync on."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "bincount", "unique",
             "masked_select", "numpy", "cpu"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name == "__getitem__" else ()
        if name in self.READS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (index if isinstance(index, tuple) else (index,))):
            raise AssertionError(f"a host read in the decode step: {name}")
        return func(*args, **(kwargs or {}))


dense = moe.MoE._dense


@pytest.mark.parametrize("batch, capturing", [(4, False), (64, False), (64, True)])
def test_a_padded_decode_step_reads_nothing_back_to_the_host(batch, capturing, monkeypatch):
    """What a capture needs: no .item(), .tolist(), bool(tensor), bincount, boolean indexing in
    the step (calls from Python; a GPU test below catches waits inside torch's ops). Batch 4
    runs every expert on every token; 64 sorts tokens by expert for torch._grouped_mm, or,
    as while capturing an fp32 model, runs every expert on every token."""
    monkeypatch.setattr(mla, "PAGED_KERNEL", False)          # the CPU kernel: numpy, not for a GPU
    monkeypatch.setattr(moe, "_capturing", lambda x: capturing)
    calls = []
    monkeypatch.setattr(moe.MoE, "_dense", lambda self, *a: (calls.append(len(a[0])), dense(self, *a))[1])
    config = preset("kimi-tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, random_weights(config, seed=3, std=0.15), dtype=torch.float32)
    pool = torch.randn(40, *model.kv_layout(16).block_shape) * 0.5
    pos = torch.arange(batch) % 50
    table = torch.arange(batch * 4).view(batch, 4) % 39
    with _NoHostReads():
        logits = model(decode_batch(pos % 256, pos, table, pool), pool)
    assert logits.shape == (batch, config.vocab_size) and torch.isfinite(logits).all()
    assert calls == ([batch] if batch == 4 or capturing else [])       # layer 1 is the MoE one
    seqs = [SeqSlice(0, 1, 10, torch.tensor([0]))]
    with pytest.raises(AssertionError, match="host read"), _NoHostReads():   # the usual step does read back
        model(StepBatch(torch.tensor([1]), torch.tensor([10]), seqs, torch.arange(1)), pool)


def _prompts() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 17, 40, 3, 64)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 12, 25, 40, 7)]
    return prompts, params


def test_the_engine_with_static_decode_steps_gives_the_same_tokens():
    """Five requests finishing at different steps (the batch shrinks through buckets 8, 4, 2,
    1), then again with their prompts cached: every token as the usual step gives it."""
    prompts, params = _prompts()
    outs, infos = {}, {}
    for static in (False, True):
        with LLM("kimi-tiny", device="cpu", cache=StoreConfig(host_capacity=None)) as llm:
            if static:
                llm._start_graphs(capture=False)
            first = llm.generate(prompts, params)
            again = llm.generate(prompts, params)            # the prompts' blocks are cached now
            outs[static] = [o.token_ids for o in first + again]
            assert sum(o.cached_tokens for o in again) > 0
            infos[static] = llm.stats().get("cuda_graphs")
    assert outs[True] == outs[False]
    assert infos[False] is None
    buckets = {bsz for bsz, _ in infos[True]["buckets"]}
    assert {8, 4, 1} <= buckets and infos[True]["failed"] is None


def test_the_scratch_page_goes_back_to_a_store_passed_in():
    model, info = load_model("kimi-tiny")
    store = StoreConfig(host_capacity=None).build(model.kv_layout(16), info.namespace(), device=model.device)
    try:
        llm = LLM("kimi-tiny", store=store)
        llm._start_graphs(capture=False)
        scratch = llm._lent[0]
        assert scratch in store.pages.owned()
        llm.close()
        assert scratch not in store.pages.owned() and not store.pages.owned()
    finally:
        store.close()


def test_the_scratch_page_is_not_counted_as_a_request_page():
    """kvtier serve's kv_pages_in_use reads pages_in_use: 0 on an idle engine whose CUDA
    graphs hold their scratch page (it read 1 on a GPU, forever), and back to 0 after requests."""
    with LLM("kimi-tiny", device="cpu", cache=StoreConfig(device_capacity="4MiB", host_capacity=None)) as llm:
        pages = llm.request_pages
        llm._start_graphs(capture=False)
        assert llm.request_pages == pages - 1 and llm.pages_in_use == 0
        llm.add_request(list(range(40)), SamplingParams(max_tokens=5, ignore_eos=True))
        seen = []
        while not llm.step():
            seen.append(llm.pages_in_use)
        assert seen and min(seen) > 0 and llm.pages_in_use == 0


def test_cuda_graphs_need_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for CPU-only machines")
    with pytest.raises(ConfigError, match="CUDA device"):
        LLM("kimi-tiny", cuda_graphs=True)
    with pytest.raises(ConfigError, match="True, False or None"):
        LLM("kimi-tiny", cuda_graphs="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
@pytest.mark.parametrize("dtype, batch", [(torch.float32, 4), (torch.float32, 64), (torch.bfloat16, 64)])
def test_on_a_gpu_the_padded_step_never_waits_for_the_device(dtype, batch, monkeypatch):
    """torch's sync debug mode raises at any op that waits for the GPU (what a capture cannot
    hold), inside C++ ops too; the MoE makes the choices it makes while capturing."""
    monkeypatch.setattr(moe, "_capturing", lambda x: True)
    config = preset("kimi-tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, random_weights(config, seed=3, std=0.15), dtype=dtype, device="cuda")
    pool = (torch.randn(40, *model.kv_layout(16).block_shape) * 0.5).to(device="cuda", dtype=dtype)
    pos = (torch.arange(batch) % 50).cuda()
    table = (torch.arange(batch * 4).view(batch, 4) % 39).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = model(decode_batch(pos % 256, pos, table, pool), pool)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (batch, config.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
@pytest.mark.parametrize("dtype, requests", [(None, 5), (None, 33)])
def test_on_a_gpu_decode_graphs_replay_the_padded_steps(dtype, requests):
    """Graphs (on by default on a GPU) against the same padded steps run eagerly: the same
    tokens, in fp32. Five requests (every MoE layer runs each expert on every token), and 33
    (batch bucket 64: every expert on every token while capturing fp32). That padded steps
    give the usual steps' tokens is checked on the CPU above; bf16 is compared step by step
    below (its greedy tokens part after a few steps: see there)."""
    prompts, params = _prompts()
    prompts, params = (prompts * 7)[:requests], (params * 7)[:requests]
    outs = {}
    for capture in (False, True):
        with LLM("kimi-tiny", device="cuda", dtype=dtype, cuda_graphs=None if capture else False,
                 cache=StoreConfig(host_capacity=None)) as llm:
            if not capture:
                llm._start_graphs(capture=False)
            outs[capture] = [o.token_ids for o in llm.generate(prompts, params)]
            info = llm.stats()["cuda_graphs"]
            assert info["capture"] is capture and info["failed"] is None and (info["replays"] > 0) is capture, info
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
@pytest.mark.parametrize("batch", [5, 33])
def test_on_a_gpu_a_bf16_graph_replays_the_eager_step_within_rounding(batch):
    """In bf16 a replayed graph may round differently from the same step run eagerly (cuBLAS
    picks its kernels with the capture's workspace), and with random weights greedy tokens
    then part after a few steps (seen on an H200). So bf16 is compared one step at a time:
    the same logits and pool within bf16 rounding, for two steps through one bucket (the
    second with new inputs). Batch 33 is bucket 64: grouped experts inside the graph."""
    from kvtier.engine.graphs import DecodeGraphs, DecodeStep

    config = preset("kimi-tiny").replace(num_hidden_layers=2)
    model = DeepseekV3(config, random_weights(config, seed=3, std=0.15), dtype=torch.bfloat16, device="cuda")
    bt, scratch = 16, 127
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(128, *model.kv_layout(bt).block_shape, generator=g) * 0.5).to("cuda", torch.bfloat16)
    rng = np.random.default_rng(0)
    positions = rng.integers(1, 40, batch).tolist()
    pages, at = [], 0
    for pos in positions:                      # each sequence its own pages, up to its second step's
        n = (pos + 1) // bt + 1
        pages.append(list(range(at, at + n)))
        at += n
    pools = {False: pool.clone(), True: pool.clone()}
    runs = {c: DecodeGraphs(model, pools[c], scratch, max_seqs=64, capture=c) for c in (False, True)}
    for step in range(2):
        ids = rng.integers(0, 256, batch).tolist()
        now = DecodeStep(ids, [p + step for p in positions], pages)
        want, got = runs[False].run(now), runs[True].run(now)
        assert got is not None and runs[True].failed is None and runs[True].replays == step + 1
        assert want.abs().max() > 1 and (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (pools[True] - pools[False]).abs().max() <= 0.05 * pools[False].abs().max()
    assert not torch.equal(pools[True][:at], pool[:at])      # the steps wrote their KV rows
