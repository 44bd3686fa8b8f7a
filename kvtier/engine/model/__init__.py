"""The reference DeepSeek-V3 / Kimi K2 model: `load_model` builds one from a preset or a checkpoint.

    model, info = load_model("kimi-tiny")               # random weights from seed 0, fp32
    model, info = load_model("/models/Kimi-K2-Instruct", dtype=torch.bfloat16, device="cuda")
    layout = model.kv_layout(block_tokens=16)            # the kvtier layout of its paged KV
    store = kvtier.Store(layout, tiers, info.namespace())
    logits = model(step_batch, kv_pool)                  # see kvtier.engine.batch

One concept per file: norm (RMSNorm), rope (rotary + YaRN), mla (attention over the paged
latent cache), mlp (SwiGLU), moe (router + experts), model (the decoder), loader.
"""
from __future__ import annotations

from kvtier.engine.model.loader import ModelInfo, load_model
from kvtier.engine.model.model import DeepseekV3, kv_variant

__all__ = ["DeepseekV3", "ModelInfo", "load_model", "kv_variant"]
