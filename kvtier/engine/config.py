"""The model's hyper-parameters: a plain dataclass read from (and written to) a Hugging Face config.json.

One `ModelConfig` describes a DeepSeek-V3-architecture model: DeepSeek-V3 itself
(model_type "deepseek_v3") and Kimi K2 (model_type "kimi_k2", the same fields). The
field names are the hub's, so `from_hf` is mostly a copy plus validation: anything the
reference engine does not implement (softmax routing, another rope scaling, attention
biases, ...) is a ConfigError here rather than wrong numbers later.

Presets: `kimi-tiny` (a 4-layer model that runs on a CPU, random weights), `deepseek-tiny`
(the same with DeepSeek-V3's next-token-prediction layer, for speculative MTP), `kimi-small`
and `kimi-medium` (random weights at GPU sizes: ~1 B and ~14.7 B parameters), and the real
`kimi-k2` and `deepseek-v3` shapes (values from their published config.json) for real
hardware. `PRESET_RANDOM_WEIGHTS` says which presets exist only with random weights,
`PRESET_GPU_ONLY` which of those are drawn on (and only run on) a GPU.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError

if TYPE_CHECKING:    # torch is imported where a dtype is needed: `kvtier --help` lists presets without it
    import torch

# model_type values whose config.json carries DeepSeek-V3 fields and whose weights use its names.
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")

_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")   # what the engine computes in
_YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate", "rope_theta"}


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi K2 hyper-parameters, with the hub's field names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int              # dense FFN (the first `first_k_dense_replace` layers)
    moe_intermediate_size: int          # one routed or shared expert
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None             # None: a plain q_proj instead of q_a_proj/q_b_proj
    kv_lora_rank: int                   # the cached latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int               # the cached rope key's width (one head, shared)
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # YaRN parameters ({"type": "yarn", ...}) or None
    max_position_embeddings: int
    moe_layer_freq: int = 1
    rope_interleave: bool = True         # the checkpoint's rope dims are in (x0,x1),(x2,x3).. pairs
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    model_type: str = "deepseek_v3"
    hidden_act: str = "silu"
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0    # DeepSeek's MTP layers, stored after the decoder: the first one
                                         # proposes drafts with speculative method "mtp", else unused
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Elements cached per token per layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        from kvtier.layout import dtype_from_name
        return dtype_from_name(self.torch_dtype, _COMPUTE_DTYPES)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    # -- validation ----------------------------------------------------------------
    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                     "n_group", "topk_group", "max_position_embeddings", "moe_layer_freq"):
            _positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {self.model_type!r} is not supported; the reference engine runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func {self.scoring_func!r} is not supported: the engine implements "
                              "DeepSeek-V3's sigmoid router only (DeepSeek-V2's softmax router is not)")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"topk_method {self.topk_method!r} is not supported: the engine implements "
                              "'noaux_tc' (grouped top-k with e_score_correction_bias) only")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; use 'silu'")
        if self.attention_bias:
            raise ConfigError("attention_bias=true is not supported: DeepSeek-V3 and Kimi K2 have no "
                              "attention biases; set it to false")
        if self.moe_layer_freq != 1:
            raise ConfigError(f"moe_layer_freq={self.moe_layer_freq} is not supported (every published "
                              "DeepSeek-V3/Kimi K2 config uses 1, and transformers ignores it); use 1")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of "
                              f"n_group ({self.n_group})")
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError(f"each expert group needs >= 2 experts (a group's score is its top-2 sum); "
                              f"got {self.n_routed_experts} experts in {self.n_group} groups")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                              f"the {self.topk_group} kept groups")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds "
                              f"num_hidden_layers ({self.num_hidden_layers})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and self.routed_scaling_factor > 0):
            raise ConfigError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
        if self.torch_dtype not in _COMPUTE_DTYPES:
            raise ConfigError(f"torch_dtype {self.torch_dtype!r} is not supported; use one of {', '.join(_COMPUTE_DTYPES)}")
        if self.rope_scaling is not None:
            _check_yarn(self.rope_scaling)

    # -- Hugging Face config.json ----------------------------------------------------
    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path) -> ModelConfig:
        """Read a config.json (a dict, the file, or the checkpoint directory holding it)."""
        d = _read_json(source) if isinstance(source, (str, Path)) else dict(source)
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config model_type {model_type!r} is not supported; the reference engine "
                              f"reads {', '.join(SUPPORTED_MODEL_TYPES)} configs")
        nkv = d.get("num_key_value_heads")
        if nkv is not None and nkv != d.get("num_attention_heads"):
            raise ConfigError(f"num_key_value_heads ({nkv}) must equal num_attention_heads "
                              f"({d.get('num_attention_heads')}): MLA has no grouped KV heads")
        rope_theta, rope_scaling = _rope_from_hf(d)
        required = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                    "routed_scaling_factor", "first_k_dense_replace")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}: not a DeepSeek-V3/Kimi K2 MoE config")
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        kw: dict[str, Any] = {k: d[k] for k in required}
        kw.update(
            q_lora_rank=d.get("q_lora_rank"),
            n_shared_experts=d.get("n_shared_experts") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            moe_layer_freq=d.get("moe_layer_freq") or 1,
            rope_interleave=bool(d.get("rope_interleave", True)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            torch_dtype=str(dtype).replace("torch.", ""),
            model_type=d.get("kvtier_model_type", model_type),
            hidden_act=d.get("hidden_act", "silu"),
            scoring_func=d.get("scoring_func", "sigmoid"),
            topk_method=d.get("topk_method", "noaux_tc"),
            attention_bias=bool(d.get("attention_bias", False)),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0,
            quantization_config=d.get("quantization_config"),
        )
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' DeepseekV3Config (and `from_hf`) loads.

        model_type is written as "deepseek_v3" (transformers has no "kimi_k2" type; the
        original is kept under "kvtier_model_type")."""
        d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                             "kvtier_model_type": self.model_type}
        for f in dataclasses.fields(self):
            if f.name in ("model_type", "quantization_config"):
                continue
            v = getattr(self, f.name)
            d[f.name] = dict(v) if isinstance(v, dict) else (list(v) if isinstance(v, list) else v)
        d["num_key_value_heads"] = self.num_attention_heads
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# -- helpers -----------------------------------------------------------------------------
def _positive_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{name} must be a positive int, got {v!r}")


def _read_json(source: str | Path) -> dict[str, Any]:
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}: pass a Hugging Face checkpoint directory or its config.json")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, YaRN dict or None) from v4's rope_theta/rope_scaling or v5's rope_parameters."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_scaling must be a JSON object or null, got {params!r}")
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"rope scaling type {kind!r} is not supported: DeepSeek-V3 and Kimi K2 use 'yarn' "
                          "(or none)")
    yarn = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    yarn["type"] = "yarn"
    if yarn.get("factor") is None:      # transformers' fallback: the context-length ratio
        orig = yarn.get("original_max_position_embeddings", d.get("max_position_embeddings"))
        yarn["factor"] = d.get("max_position_embeddings", 4096) / orig
    yarn.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
    return float(theta), yarn


def _check_yarn(y: dict[str, Any]) -> None:
    unknown = set(y) - _YARN_KEYS
    if unknown:
        raise ConfigError(f"rope_scaling has keys the engine does not implement: {sorted(unknown)}")
    if y.get("type", y.get("rope_type")) != "yarn":
        raise ConfigError(f"rope_scaling type {y.get('type')!r} is not supported; use 'yarn' or null")
    if not isinstance(y.get("factor"), (int, float)) or y["factor"] <= 0:
        raise ConfigError(f"rope_scaling.factor must be > 0, got {y.get('factor')!r}")
    if not isinstance(y.get("original_max_position_embeddings"), int) or y["original_max_position_embeddings"] <= 0:
        raise ConfigError("rope_scaling.original_max_position_embeddings must be a positive int, got "
                          f"{y.get('original_max_position_embeddings')!r}")


# -- presets -----------------------------------------------------------------------------
_KIMI_TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, q_lora_rank=192, kv_lora_rank=128,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.827, norm_topk_prob=True, first_k_dense_replace=1,
    rms_norm_eps=1e-6, rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 512,
                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=8192, bos_token_id=256, eos_token_id=257, torch_dtype="float32",
    model_type="kimi_k2",
)

# kimi-tiny's architecture at GPU size, random weights: ~1.0 B parameters (2 GB in bf16), 8
# layers (1 dense, 7 MoE of 32 + 1 shared experts, top 4), Kimi K2's MLA widths (kv_lora_rank
# 512, rope 64: 9.2 KB of KV per token). Small enough to draw its weights on a CPU in seconds
# (they are drawn in fp32 from a seed), big enough that a GPU's kernels, not Python, set decode speed.
_KIMI_SMALL = dict(
    _KIMI_TINY, vocab_size=32768, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=512,
    num_hidden_layers=8, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=32, num_experts_per_tok=4,
    rope_scaling=dict(_KIMI_TINY["rope_scaling"], original_max_position_embeddings=2048),
    max_position_embeddings=32768, torch_dtype="bfloat16",
)

# moonshotai/Kimi-K2-Instruct config.json (the 0905 revision has factor 64 and 262144 positions).
_KIMI_K2 = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
    routed_scaling_factor=2.827, norm_topk_prob=True, first_k_dense_replace=1,
    rms_norm_eps=1e-6, rope_theta=50000.0,
    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=131072, bos_token_id=163584, eos_token_id=163585, torch_dtype="bfloat16",
    model_type="kimi_k2",
)

# Kimi K2's layers at their real widths (hidden 7168, 64 heads, MLA 1536 / 512 / 64, experts
# of 2048, top 8, its 163,840-token vocabulary), 5 of them (1 dense, 4 MoE of 64 routed + 1
# shared experts) instead of 61 and 384: ~14.7 B parameters, 27.4 GiB in bf16, random
# weights. A quarter of an H100 or a fifth of an H200, with the kernel shapes of the real
# model, so a GPU's decode speed is measured where memory bandwidth, not launches, sets it.
# Its weights are drawn on the GPU (60 GB in fp32 would take minutes on a CPU).
_KIMI_MEDIUM = dict(_KIMI_K2, num_hidden_layers=5, n_routed_experts=64)

# deepseek-ai/DeepSeek-V3 config.json (its one MTP layer is stored as layer 61 and ignored).
_DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
    rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    max_position_embeddings=163840, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    model_type="deepseek_v3", num_nextn_predict_layers=1,
)

# kimi-tiny's shapes as a DeepSeek-V3 with one next-token-prediction (MTP) layer after its
# 4 layers, as DeepSeek-V3 has: for speculative decoding with method "mtp" on a CPU.
_DEEPSEEK_TINY = dict(_KIMI_TINY, model_type="deepseek_v3", num_nextn_predict_layers=1)

_PRESETS: dict[str, dict[str, Any]] = {"kimi-tiny": _KIMI_TINY, "kimi-k2": _KIMI_K2, "deepseek-v3": _DEEPSEEK_V3,
                                       "deepseek-tiny": _DEEPSEEK_TINY, "kimi-small": _KIMI_SMALL,
                                       "kimi-medium": _KIMI_MEDIUM}

# Presets with no published weights: a model built from one has random weights (load_model
# makes them from a seed). The real shapes' weights come from a checkpoint directory instead.
PRESET_RANDOM_WEIGHTS = frozenset({"kimi-tiny", "deepseek-tiny", "kimi-small", "kimi-medium"})
# Random-weight presets too large to draw on a CPU: drawn on the GPU, in the compute dtype.
PRESET_GPU_ONLY = frozenset({"kimi-medium"})


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset(name: str) -> ModelConfig:
    """A named configuration: "kimi-tiny" (CPU-sized, random weights), "deepseek-tiny" (the same
    with an MTP layer), "kimi-small" (GPU-sized, ~1 B parameters, random weights), "kimi-medium"
    (Kimi K2's layer widths, 5 layers, ~14.7 B parameters, random weights drawn on a GPU),
    "kimi-k2", "deepseek-v3"."""
    if name not in _PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(_PRESETS)} "
                          "or pass a checkpoint directory")
    kw = dict(_PRESETS[name])
    kw["rope_scaling"] = dict(kw["rope_scaling"]) if kw.get("rope_scaling") else None
    return ModelConfig(**kw)
