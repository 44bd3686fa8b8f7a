"""The reference engine's model against its oracle, transformers' DeepseekV3ForCausalLM.

Same weights (saved in hub layout by save_checkpoint, loaded by both), fp32: our paged,
absorbed-MLA forward must give transformers' logits within 1e-4 for a whole prompt, for
chunked prefill plus step-by-step decode, for several sequences in one batch, with YaRN
on at positions past its original context; plus config, loader and layout checks.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvtier.engine.batch import SeqSlice, StepBatch
from kvtier.engine.config import ModelConfig, preset, preset_names
from kvtier.engine.model import DeepseekV3, load_model
from kvtier.engine.weights import load_checkpoint, random_weights, save_checkpoint
from kvtier.keys import checkpoint_revision
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import Namespace

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

torch.set_num_threads(1)

TOL = 1e-4
BLOCK = 16

# Small enough to run in well under a second, large enough to exercise every path: q_lora,
# YaRN (factor 4 over 16 original positions, mscale != mscale_all_dim), grouped routing
# (4 groups, keep 2), a shared expert, a dense first layer.
SMALL = preset("kimi-tiny").replace(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, max_position_embeddings=64,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
VARIANTS = {
    "qlora-yarn-pairs": SMALL,
    # Kimi K2's own rope parameters (beta_fast == beta_slow: a zero-width ramp).
    "kimi-yarn": SMALL.replace(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                             "mscale_all_dim": 1.0}),
    # q_proj instead of q_a/q_b, plain rope in halves order, one group, 2 shared experts, tied head,
    # rms_norm_eps != the MLA norms' fixed 1e-6.
    "qproj-halves-tied": SMALL.replace(q_lora_rank=None, rope_scaling=None, rope_interleave=False, n_group=1,
                                       topk_group=1, n_shared_experts=2, tie_word_embeddings=True,
                                       first_k_dense_replace=2, norm_topk_prob=False, rms_norm_eps=1e-5),
}
STD = 0.15   # larger than HF's 0.02 init so attention is peaked and every term shows in the logits


# -- helpers ---------------------------------------------------------------------------------
class Pages:
    """A NaN-filled pool and a scrambled slot allocator: reading an unwritten row poisons the logits."""

    def __init__(self, model: DeepseekV3, slots: int = 24, seed: int = 0) -> None:
        self.pool = torch.full((slots, *model.kv_layout(BLOCK).block_shape), float("nan"), device=model.device)
        self.free = [(7 * i + seed) % slots for i in range(slots)]     # pops 17, 10, 3, 20, ... (slots=24)
        self.pages: dict[str, list[int]] = {}

    def ensure(self, seq: str, total: int) -> torch.Tensor:
        pages = self.pages.setdefault(seq, [])
        while len(pages) * BLOCK < total:
            pages.append(self.free.pop())
        return torch.tensor(pages)


def step(model: DeepseekV3, pages: Pages, chunks: list[tuple[str, list[int], int]],
         before_layer=None) -> torch.Tensor:
    """One forward over several sequences' chunks (name, new tokens, context); logits of every new token."""
    ids, pos, seqs, start = [], [], [], 0
    for name, toks, context in chunks:
        seqs.append(SeqSlice(start, len(toks), context, pages.ensure(name, context + len(toks))))
        ids += toks
        pos += range(context, context + len(toks))
        start += len(toks)
    dev = pages.pool.device
    batch = StepBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), seqs,
                      torch.arange(len(ids), device=dev), before_layer)
    return model(batch, pages.pool)


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(our model, transformers' model, state) loaded from one saved random checkpoint."""
    config = VARIANTS[request.param]
    state = random_weights(config, seed=7, std=STD)
    path = tmp_path_factory.mktemp(request.param)
    save_checkpoint(path, config, state, max_shard_bytes=64 << 10)      # several shards + index
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), f"transformers did not load every weight: {info}"
    return load_model(path, device="cpu")[0], hf.eval(), state      # the oracle runs on the CPU


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- 1. whole prompt ------------------------------------------------------------------------
def test_prefill_matches_transformers(pair):
    model, hf, state = pair
    tokens = prompt(40)                          # 3 pages of 16, positions past YaRN's original 16
    pages = Pages(model)
    ours = step(model, pages, [("a", tokens, 0)])
    ref = reference_logits(hf, tokens)
    assert ref.std() > 0.3                       # logits carry signal, so 1e-4 means something
    assert (ours - ref).abs().max() < TOL
    assert pages.pages["a"] != sorted(pages.pages["a"])   # the pages really were scrambled

    # Every norm's eps is transformers' (a wrong latent-norm eps moves logits by only ~5e-5).
    from kvtier.engine.model.norm import RMSNorm
    norms = [(name, m.eps) for name, m in model.named_modules() if isinstance(m, RMSNorm)]
    assert norms and all(hf.get_submodule(name).variance_epsilon == eps for name, eps in norms)

    # transformers fused the hub's per-expert tensors into [experts, 2*inter, hidden]: same numbers.
    layer = model.config.first_k_dense_replace
    experts = hf.model.layers[layer].mlp.experts
    for j in (0, model.config.n_routed_experts - 1):
        p = f"model.layers.{layer}.mlp.experts.{j}."
        gate_up = torch.cat([state[p + "gate_proj.weight"], state[p + "up_proj.weight"]])
        assert torch.equal(experts.gate_up_proj[j], gate_up)
        assert torch.equal(experts.down_proj[j], state[p + "down_proj.weight"])


def test_wrong_pages_or_positions_are_caught(pair):
    """The comparison above can fail: reading another sequence's pages, or rope frequencies
    1% off, move the logits far past the tolerance. (Reordering a sequence's own full
    pages would not: the cached keys carry their rope, and attention ignores key order.)"""
    model, hf, _ = pair
    tokens, other = prompt(40), prompt(40, seed=9)
    ref = reference_logits(hf, tokens)
    pages = Pages(model)
    step(model, pages, [("a", tokens[:39], 0), ("b", other[:39], 0)])
    good = step(model, pages, [("a", tokens[39:], 39)])
    assert (good[-1] - ref[-1]).abs().max() < TOL
    pages.pages["a"][0] = pages.pages["b"][0]                # a's first 16 tokens read from b's page
    wrong = step(model, pages, [("a", tokens[39:], 39)])
    assert (wrong[-1] - ref[-1]).abs().max() > 100 * TOL
    inv_freq = model.rotary.inv_freq.clone()
    try:
        model.rotary.inv_freq.mul_(1.01)                     # rope frequencies 1% off
        off = step(model, Pages(model), [("a", tokens, 0)])
    finally:
        model.rotary.inv_freq.copy_(inv_freq)
    assert (off - ref).abs().max() > 100 * TOL


# -- 2. chunked prefill, then decode one token at a time ----------------------------------------
def test_chunked_prefill_then_decode_matches_transformers(pair):
    model, hf, _ = pair
    tokens = prompt(25, seed=1)
    pages = Pages(model)
    logits = [step(model, pages, [("a", tokens[:13], 0)]), step(model, pages, [("a", tokens[13:], 13)])]
    for _ in range(10):                          # greedy decode to position 34
        nxt = int(logits[-1][-1].argmax())
        logits.append(step(model, pages, [("a", [nxt], len(tokens))]))
        tokens.append(nxt)
    ours = torch.cat(logits)                     # every position's logits, from the paged cache
    ref = reference_logits(hf, tokens)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() < TOL


# -- 3. several sequences in one step ------------------------------------------------------------
def test_batched_sequences_equal_each_alone(pair):
    model, _, _ = pair
    a, b = prompt(11, seed=2), prompt(21, seed=3)

    alone = Pages(model, seed=1)
    step(model, alone, [("b", b[:20], 0)])
    b_alone = step(model, alone, [("b", b[20:], 20)])
    a_alone = step(model, alone, [("a", a, 0)])

    mixed = Pages(model, seed=2)
    step(model, mixed, [("b", b[:20], 0)])
    both = step(model, mixed, [("a", a, 0), ("b", b[20:], 20)])   # a prefill and a decode together
    assert (both[:11] - a_alone).abs().max() < 1e-5
    assert (both[11:] - b_alone).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
def test_on_a_gpu_the_model_gives_the_cpu_logits(pair):
    """The same weights on CUDA: a prefill and a mixed prefill + decode step give the CPU's
    logits (fp32; the CPU model is the one checked against transformers above)."""
    model, _, state = pair
    gpu = DeepseekV3(model.config, state, dtype=torch.float32, device="cuda")
    a, b = prompt(30, seed=8), prompt(19, seed=9)
    out = {}
    for name, m in (("cpu", model), ("cuda", gpu)):
        pages = Pages(m, seed=3)
        first = step(m, pages, [("a", a[:20], 0)])
        both = step(m, pages, [("a", a[20:], 20), ("b", b, 0)])
        out[name] = torch.cat([first, both]).cpu()
    assert out["cuda"].isfinite().all()
    assert (out["cuda"] - out["cpu"]).abs().max() < 1e-3


@pytest.mark.parametrize("form", ["absorbed", "absorbed-torch", "up"])
def test_both_attention_forms_match_transformers(pair, form, monkeypatch):
    """The model picks the absorbed or the up-projected MLA form per sequence by FLOPs
    (decode absorbed, long chunks up-projected); each form alone must match the oracle for
    a whole prompt, chunks after a cached context, decode, and several sequences at once.
    "absorbed" runs the C kernel kvtier._mla where it is built, "absorbed-torch" the torch ops."""
    from kvtier.engine.model import mla
    monkeypatch.setattr(mla, "FORCE_FORM", form.split("-")[0])
    monkeypatch.setattr(mla, "PAGED_KERNEL", form != "absorbed-torch")
    model, hf, _ = pair
    tokens, other = prompt(40, seed=5), prompt(23, seed=6)
    pages = Pages(model)
    assert (step(model, pages, [("a", tokens, 0)]) - reference_logits(hf, tokens)).abs().max() < TOL
    logits = [step(model, pages, [("b", other[:7], 0)]), step(model, pages, [("b", other[7:], 7)])]
    for _ in range(3):
        nxt = int(logits[-1][-1].argmax())
        mixed = step(model, pages, [("b", [nxt], len(other)), ("c", tokens[:9], 0)])   # decode + prefill
        assert (mixed[1:] - reference_logits(hf, tokens[:9])).abs().max() < TOL
        pages.pages.pop("c")
        logits.append(mixed[:1])
        other.append(nxt)
    assert (torch.cat(logits) - reference_logits(hf, other)).abs().max() < TOL
    # two prompts from scratch, of different lengths, in one step (padded, one causal kernel)
    both = step(model, Pages(model), [("d", tokens[:17], 0), ("e", other[:30], 0)])
    assert (both[:17] - reference_logits(hf, tokens[:17])).abs().max() < TOL
    assert (both[17:] - reference_logits(hf, other[:30])).abs().max() < TOL


def test_the_form_follows_the_flop_count():
    from kvtier.engine.model.mla import prefer_up_projected
    k2 = preset("kimi-k2")
    assert not prefer_up_projected(k2, 1, 4096)            # decode: absorbed
    assert not prefer_up_projected(k2, 16, 4096)           # one block after a long cached prefix
    assert prefer_up_projected(k2, 512, 512)               # a prefill chunk: up-projected
    assert prefer_up_projected(k2, 512, 4096)


def test_before_layer_runs_before_each_layer_reads_the_pool(pair):
    """A layer-wise loader fills layer l of the cached pages inside before_layer(l): the step
    must give the same logits as with everything in place."""
    model, _, _ = pair
    tokens = prompt(30, seed=4)
    pages = Pages(model)
    step(model, pages, [("a", tokens[:29], 0)])
    expected = step(model, pages, [("a", tokens[29:], 29)])
    cached = pages.pool.clone()
    pages.pool.fill_(float("nan"))               # nothing is in place until its layer is asked for
    calls = []

    def before_layer(layer: int) -> None:
        calls.append(layer)
        pages.pool[:, layer] = cached[:, layer]

    got = step(model, pages, [("a", tokens[29:], 29)], before_layer=before_layer)
    assert calls == list(range(model.config.num_hidden_layers))
    assert torch.equal(got, expected)


# -- 4. YaRN -------------------------------------------------------------------------------------
def test_yarn_changes_the_numbers_it_should():
    """The same weights without rope scaling give other logits past the first token: the
    YaRN frequencies and both mscale terms are in use (and match transformers above)."""
    tokens = prompt(40, seed=5)
    out = {}
    for name, cfg in (("yarn", SMALL), ("plain", SMALL.replace(rope_scaling=None))):
        model = DeepseekV3(cfg, random_weights(cfg, seed=7, std=STD))
        out[name] = step(model, Pages(model), [("a", tokens, 0)])
    assert (out["yarn"][0] - out["plain"][0]).abs().max() < 1e-5    # one key at position 0: nothing to rotate
    assert (out["yarn"][20:] - out["plain"][20:]).abs().max() > 1e-2


def test_rope_frequencies_match_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from kvtier.engine.model.rope import rope_frequencies, softmax_scale
    for cfg in (preset("kimi-k2"), preset("deepseek-v3"), VARIANTS["qlora-yarn-pairs"], preset("kimi-tiny")):
        hf_cfg = transformers.DeepseekV3Config(**cfg.to_hf())
        ref = DeepseekV3RotaryEmbedding(hf_cfg)
        inv_freq, factor = rope_frequencies(cfg)
        assert torch.equal(inv_freq, ref.inv_freq) and factor == ref.attention_scaling
        small = hf_cfg.__class__(**{**cfg.to_hf(), "hidden_size": 8, "num_attention_heads": 1,
                                    "q_lora_rank": 4, "kv_lora_rank": 4})
        assert softmax_scale(cfg) == DeepseekV3Attention(small, 0).scaling


# -- the router ------------------------------------------------------------------------------------
def test_router_matches_transformers_with_a_strong_bias():
    """The correction bias picks the experts; the weights come from the un-biased scores."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from kvtier.engine.model.moe import Router
    cfg = SMALL.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    ours = Router(cfg)
    theirs = DeepseekV3TopkRouter(transformers.DeepseekV3Config(**cfg.to_hf()))
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(16, 64, generator=g) * 0.1, torch.randn(16, generator=g)
    for r in (ours, theirs):
        r.weight.data.copy_(weight)
        r.e_score_correction_bias.copy_(bias)
    x = torch.randn(50, 64, generator=g)
    ids, w = ours(x)
    _, ref_w, ref_ids = theirs(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)
    unbiased = Router(cfg)
    unbiased.weight.data.copy_(weight)
    assert not torch.equal(unbiased(x)[0].sort(-1).values, ids.sort(-1).values)   # the bias mattered


def test_rms_norm_is_torchs_formula_bit_for_bit():
    """The CPU RMSNorm (5 ops, not F.rms_norm's composite) gives F.rms_norm's bytes."""
    from kvtier.engine.model.norm import rms_norm
    g = torch.Generator().manual_seed(0)
    for t, d in ((1, 256), (16, 512), (300, 1536)):
        x, w = torch.randn(t, d, generator=g) * 3, torch.randn(d, generator=g)
        assert torch.equal(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (d,), w, 1e-6))
        assert torch.equal(rms_norm(x, None, 1e-5), torch.nn.functional.rms_norm(x, (d,), eps=1e-5))


@pytest.mark.parametrize("shared", [1, 2])          # 2: the shared expert is wider, not fused in
def test_moe_dense_path_equals_grouped_and_loop(shared, monkeypatch):
    """Few tokens run every expert densely (zero weight where not routed); the result is the
    sorted grouped path's and the unfused per-expert loop's (transformers' way). Experts too
    large to read all of them (DENSE_MAX_BYTES) take the grouped path however few the tokens."""
    from kvtier.engine.model import moe as moe_mod
    cfg = SMALL.replace(n_shared_experts=shared)
    model = DeepseekV3(cfg, random_weights(cfg, seed=2, std=STD), dtype=torch.float32)
    block = model.model.layers[cfg.first_k_dense_replace].mlp
    calls, real = [], moe_mod.MoE._dense
    monkeypatch.setattr(moe_mod.MoE, "_dense", lambda self, *a: (calls.append(len(a[0])), real(self, *a))[1])
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(moe_mod, "DENSE_MAX_ROWS", 0)
    grouped = block(x)
    monkeypatch.setattr(moe_mod, "DENSE_MAX_ROWS", 10 ** 6)
    dense = block(x)
    loop = block._loop(x, *block.gate(x))
    assert grouped.abs().max() > 0.1 and calls == [16]
    assert (dense - grouped).abs().max() < 1e-5 and (dense - loop).abs().max() < 1e-5
    monkeypatch.setattr(moe_mod, "DENSE_MAX_BYTES", block._stacked_bytes() - 1)
    assert torch.equal(block(x), grouped) and calls == [16]


# -- 5. the KV layout ---------------------------------------------------------------------------------
def test_kv_layout_variant_tracks_what_the_bytes_mean():
    model, _ = load_model("kimi-tiny")
    layout = model.kv_layout(BLOCK)
    assert (layout.kind, layout.num_layers, layout.kv_lora_rank, layout.rope_dim) == ("mla", 4, 128, 32)
    assert layout.dtype == torch.float32 and layout.block_tokens == BLOCK
    assert layout.variant.startswith("kvtier-mla1;rope=pairs;latent_eps=1e-06;compute=float32;cfg=")
    assert load_model("kimi-tiny", seed=3)[0].kv_layout(BLOCK).fingerprint == layout.fingerprint  # weights: namespace
    assert model.kv_layout(BLOCK, torch.bfloat16).fingerprint != layout.fingerprint
    fingerprints = {layout.fingerprint}
    cfg = model.config
    for changed in (cfg.replace(rope_interleave=False), cfg.replace(rope_theta=10000.0), cfg.replace(rope_scaling=None),
                    cfg.replace(rope_scaling={**cfg.rope_scaling, "factor": 4.0}), cfg.replace(rms_norm_eps=1e-5),
                    cfg.replace(routed_scaling_factor=2.5)):
        other = DeepseekV3(changed, random_weights(changed, seed=0)).kv_layout(BLOCK)
        fingerprints.add(other.fingerprint)
    assert len(fingerprints) == 7
    bf16, _ = load_model("kimi-tiny", dtype="bfloat16")
    assert "compute=bfloat16" in bf16.kv_layout(BLOCK).variant
    assert bf16.kv_layout(BLOCK, torch.float32).fingerprint != layout.fingerprint   # same storage, other compute
    # the token ids and the checkpoint's storage dtype do not change a cached byte
    same = cfg.replace(eos_token_id=1, torch_dtype="bfloat16")
    same_model = DeepseekV3(same, random_weights(same), dtype=torch.float32)
    assert same_model.kv_layout(BLOCK).fingerprint == layout.fingerprint


def test_pool_of_the_wrong_shape_is_a_layout_error():
    model, _ = load_model("kimi-tiny")
    batch = StepBatch(torch.tensor([1, 2]), torch.tensor([0, 1]), [SeqSlice(0, 2, 0, torch.tensor([0]))],
                      torch.tensor([1]))
    with pytest.raises(LayoutError, match="kv_pool"):
        model(batch, torch.zeros(2, 4, BLOCK, 96))
    with pytest.raises(LayoutError, match="pages"):
        model(StepBatch(torch.arange(20), torch.arange(20), [SeqSlice(0, 20, 0, torch.tensor([0]))],
                        torch.tensor([19])), torch.zeros(2, *model.kv_layout(BLOCK).block_shape))


# -- loader ------------------------------------------------------------------------------------------
def test_loader_errors_name_the_tensor(tmp_path):
    cfg = SMALL
    state = random_weights(cfg, seed=0)
    save_checkpoint(tmp_path, cfg, state)
    assert all(torch.equal(v, state[k]) for k, v in load_checkpoint(tmp_path).items())
    model, info = load_model(tmp_path)
    assert not info.random_weights and info.tokenizer_path == str(tmp_path)
    assert info.revision == checkpoint_revision(tmp_path) and info.revision.startswith("ckpt-")
    tuned = dict(state, **{"model.norm.weight": state["model.norm.weight"] * 1.5})
    save_checkpoint(tmp_path / "tuned", cfg, tuned)
    assert checkpoint_revision(tmp_path / "tuned") != info.revision         # other weights, other namespace

    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    partial = {k: v for k, v in state.items() if k != name}
    safetensors_torch.save_file(partial, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path)

    bad = dict(state, **{"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(3, 3)})
    safetensors_torch.save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight has shape \(3, 3\)"):
        load_checkpoint(tmp_path)

    extra = dict(state, **{"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2)})
    safetensors_torch.save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\.0"):
        load_checkpoint(tmp_path)

    # DeepSeek's MTP layer (index num_hidden_layers) is skipped, not an error
    mtp = dict(state, **{"model.layers.3.eh_proj.weight": torch.zeros(2, 2)})
    safetensors_torch.save_file(mtp, str(tmp_path / "model.safetensors"))
    assert set(load_checkpoint(tmp_path)) == set(state)

    with pytest.raises(ConfigError, match="lacks tensor"):
        DeepseekV3(cfg, partial)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path / "empty")
    with pytest.raises(ConfigError, match="neither a model preset"):
        load_model("kimi-huge")


def quantize_fp8(w: torch.Tensor, block: int):
    """DeepSeek's block-wise FP8: one scale per block x block tile (edge tiles partial)."""
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = w
    scale = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def test_fp8_block_quantized_checkpoint_is_dequantized(tmp_path):
    cfg = SMALL.replace(quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                                             "activation_scheme": "dynamic"})
    state = random_weights(cfg, seed=0)
    stored, expected = {}, {}
    for name, w in state.items():
        if name.endswith("proj.weight") or name.endswith("mqa.weight"):    # DeepSeek quantizes the linears
            stored[name], stored[name + "_scale_inv"], expected[name] = quantize_fp8(w, 16)
        else:
            stored[name] = expected[name] = w
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    safetensors_torch.save_file(stored, str(tmp_path / "model.safetensors"))
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    w = state["model.layers.0.self_attn.o_proj.weight"]
    assert (loaded["model.layers.0.self_attn.o_proj.weight"] - w).abs().max() < w.abs().max() / 16   # e4m3: 3 bits

    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_hf(), "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ConfigError, match="quantization 'awq'"):
        load_checkpoint(tmp_path)


def test_random_weights_are_deterministic():
    a, b, c = (random_weights(SMALL, seed=s) for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    model, info = load_model("kimi-tiny")
    assert model.random_weights and info.random_weights and info.tokenizer_path is None
    assert info.namespace() == Namespace(model="kimi-tiny", revision="random-seed0")
    assert load_model("kimi-tiny", seed=1)[1].namespace() != info.namespace()     # other weights, other blocks
    assert model.dtype == torch.float32 and model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="checkpoint directory"):
        load_model("kimi-k2")                        # its weights come from a checkpoint, not a seed


# -- 6. config ---------------------------------------------------------------------------------------
KIMI_K2_CONFIG_JSON = {   # moonshotai/Kimi-K2-Instruct config.json (auto_map omitted)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 163840,
}


def test_config_from_hf(tmp_path):
    k2 = ModelConfig.from_hf(KIMI_K2_CONFIG_JSON)
    assert k2 == preset("kimi-k2")
    assert k2.quantization_config["weight_block_size"] == [128, 128]
    assert k2.kv_entry_dim == 576 and k2.model_type == "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2_CONFIG_JSON))
    assert ModelConfig.from_hf(tmp_path) == k2 == ModelConfig.from_hf(tmp_path / "config.json")

    v5 = ModelConfig.from_hf(transformers.DeepseekV3Config().to_dict())     # v5 writes rope_parameters
    assert v5.rope_scaling is None and v5.rope_theta == 10000.0 and v5.n_routed_experts == 256
    for name in preset_names():                     # to_hf round-trips, through transformers too
        cfg = preset(name)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_hf(transformers.DeepseekV3Config(**cfg.to_hf()).to_dict()) == cfg


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"model_type": "llama"}, "model_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling type 'linear'"),
    ({"rope_scaling": {**KIMI_K2_CONFIG_JSON["rope_scaling"], "low_freq_factor": 1.0}}, "low_freq_factor"),
    ({"n_group": 5}, "multiple of n_group"),
    ({"topk_group": 2}, "topk_group"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_config_rejects_what_the_engine_does_not_implement(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**KIMI_K2_CONFIG_JSON, **change})


def test_gpu_sized_random_weights_are_drawn_on_the_device_and_refused_on_a_cpu():
    with pytest.raises(ConfigError, match="for a GPU"):
        load_model("kimi-medium", device="cpu")
    config = preset("kimi-tiny")
    a = random_weights(config, seed=5, dtype=torch.bfloat16, device="cpu")
    b = random_weights(config, seed=5, dtype=torch.bfloat16, device="cpu")
    assert a.keys() == random_weights(config, seed=5).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)                                # the seed fixes them
    assert not torch.equal(a["lm_head.weight"], random_weights(config, seed=6, dtype=torch.bfloat16,
                                                               device="cpu")["lm_head.weight"])
    bias = next(k for k in a if k.endswith("e_score_correction_bias"))
    assert a[bias].dtype == torch.float32 and a["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    assert 0.08 < a["lm_head.weight"].float().std() < 0.12
    model = DeepseekV3(config, a, dtype=torch.bfloat16)                            # a model takes them
    assert model.dtype == torch.bfloat16


def test_presets():
    assert preset_names() == ["kimi-tiny", "kimi-k2", "deepseek-v3", "deepseek-tiny", "kimi-small", "kimi-medium"]
    small = preset("kimi-small")
    small.validate()
    assert small.kv_entry_dim == preset("kimi-k2").kv_entry_dim and small.torch_dtype == "bfloat16"
    medium, k2 = preset("kimi-medium"), preset("kimi-k2")
    medium.validate()
    assert medium.replace(num_hidden_layers=61, n_routed_experts=384) == k2       # K2's widths, fewer of them
    params = sum(math.prod(s) for s in DeepseekV3.skeleton(medium).values())
    assert 14.0e9 < params < 15.5e9                                               # what docs/engine.md says
    assert preset("deepseek-tiny").num_nextn_predict_layers == 1
    tiny = preset("kimi-tiny")
    assert tiny.vocab_size >= 258 and tiny.q_lora_rank and tiny.rope_scaling["type"] == "yarn"
    assert tiny.n_group > 1 and tiny.topk_group < tiny.n_group and tiny.first_k_dense_replace == 1
    assert preset("deepseek-v3").num_nextn_predict_layers == 1
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("kimi-k3")
