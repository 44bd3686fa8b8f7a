"""Tiny random-weight checkpoints that vLLM loads offline: a Llama-like (GQA) model and a
DeepSeek-V3 (MLA + MoE) model, each with a small word-level tokenizer.

Used by tests/test_vllm_connector.py and bench/vllm_connector.py. The weights are written
straight to safetensors under the names vLLM's loaders expect (no transformers model is
instantiated), from a seeded generator, so every process that builds a model from the
same arguments gets the same bytes. Weights are scaled so that logits are well spread:
greedy decoding then has no near-ties, and two runs that compute the same KV a little
differently (a loaded prefix vs. a full prefill) still pick the same tokens.

    path = write_model(tmp_path / "llama", "llama")       # or "deepseek_v3"
    LLM(model=str(path), tokenizer=str(path), ...)

Word ids: token id i is the word "w{i}"; 0..2 are <unk>, <s>, </s>.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB = 512
SPECIAL = ("<unk>", "<s>", "</s>")


def write_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A whitespace word-level tokenizer (tokenizer.json + config) with `vocab` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)}
    words.update({f"w{i}": i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def _decoder_shapes(layers: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The weights every decoder here has: embeddings, final norm, LM head, per-layer norms."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden),
                                         "model.norm.weight": (hidden,), "lm_head.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    return shapes


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, inter: int, max_len: int) -> tuple[dict, dict]:
    head_dim = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
           "torch_dtype": "float32"}
    shapes = _decoder_shapes(layers, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    return cfg, shapes


def _deepseek_v3(layers: int, hidden: int, heads: int, inter: int, max_len: int,
                 experts: int = 4) -> tuple[dict, dict]:
    # The CPU MLA backend needs kv_lora_rank 512 and a rope dim of 64 (576 cached per token).
    lora, rope, nope, v = 512, 64, 32, 32
    moe_inter, shared = 64, 1
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB,
           "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
           "q_lora_rank": None, "kv_lora_rank": lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
           "v_head_dim": v, "n_routed_experts": experts, "n_shared_experts": shared,
           "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
           "norm_topk_prob": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_scaling": None,
           "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
           "num_nextn_predict_layers": 0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    shapes = _decoder_shapes(layers, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * (nope + rope), hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": (lora + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": (lora,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), lora),
            p + "self_attn.o_proj.weight": (hidden, heads * v)})
        if i < cfg["first_k_dense_replace"]:
            shapes.update({p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                           p + "mlp.down_proj.weight": (hidden, inter)})
            continue
        shapes.update({p + "mlp.gate.weight": (experts, hidden), p + "mlp.gate.e_score_correction_bias": (experts,)})
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (moe_inter, hidden), q + "up_proj.weight": (moe_inter, hidden),
                           q + "down_proj.weight": (hidden, moe_inter)})
        s = moe_inter * shared
        shapes.update({p + "mlp.shared_experts.gate_proj.weight": (s, hidden),
                       p + "mlp.shared_experts.up_proj.weight": (s, hidden),
                       p + "mlp.shared_experts.down_proj.weight": (hidden, s)})
    return cfg, shapes


def _weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights: norms 1, biases 0, embeddings N(0, 1), matrices N(0, 1/fan_in) (lm_head x4)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        else:
            scale = 4.0 if name == "lm_head.weight" else 1.0
            t = torch.randn(shape, generator=g) * (scale / math.sqrt(shape[-1]))
        out[name] = t.contiguous()
    return out


def write_model(path: Path | str, kind: str, *, layers: int = 2, max_len: int = 2048, seed: int = 0,
                hidden: int = 128, heads: int | None = None, kv_heads: int | None = None, inter: int | None = None,
                experts: int = 4) -> Path:
    """Write a tiny `kind` ("llama" or "deepseek_v3") checkpoint and tokenizer into `path`
    (bigger shapes for benchmarks: hidden, heads, kv_heads, inter; routed experts for deepseek_v3)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "llama":
        cfg, shapes = _llama(layers, hidden=hidden, heads=heads or 4, kv_heads=kv_heads or 2, inter=inter or 2 * hidden,
                             max_len=max_len)
    elif kind == "deepseek_v3":
        cfg, shapes = _deepseek_v3(layers, hidden=hidden, heads=heads or 2, inter=inter or 2 * hidden, max_len=max_len,
                                    experts=experts)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}: use 'llama' or 'deepseek_v3'")
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(_weights(shapes, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path)
    return path


def prompt_ids(n: int, seed: int, *, prefix: list[int] | None = None) -> list[int]:
    """`n` seeded word ids (no specials), after `prefix` if given: a shared prefix + a fresh tail."""
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(len(SPECIAL), VOCAB, (n,), generator=g).tolist()
    return list(prefix or []) + tail
