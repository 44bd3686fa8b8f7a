"""Named KV layouts of well-known models, as plain data (dtype by name) so the CLI can
list them in --help without importing torch; kvtier.layout.preset_layout builds them."""
from __future__ import annotations

from typing import Any

LAYOUT_PRESETS: dict[str, dict[str, Any]] = {
    # Kimi K2 / DeepSeek-V3: 61 layers, MLA 512 + 64, bf16 -> 70,272 B per token.
    "kimi-k2": dict(kind="mla", num_layers=61, kv_lora_rank=512, rope_dim=64, dtype="bfloat16"),
    "deepseek-v3": dict(kind="mla", num_layers=61, kv_lora_rank=512, rope_dim=64, dtype="bfloat16"),
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16 -> 131,072 B per token.
    "llama3-8b": dict(kind="mha", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
    # Llama-3.1-70B: 80 layers, 8 KV heads of 128, bf16 -> 327,680 B per token.
    "llama3-70b": dict(kind="mha", num_layers=80, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
