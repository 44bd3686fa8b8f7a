"""The DeepSeek-V3 / Kimi K2 decoder: embed, N x (MLA + FFN), final norm, lm_head.

With `mtp=True` the checkpoint's first next-token-prediction layer is built too, where the
hub stores it (`model.layers.{N}.`: enorm, hnorm, eh_proj, embed_tokens, shared_head, and
one decoder block): `forward_mtp` runs it, and its KV is layer N of the same pages (the
layout then has N + 1 layers), so cached blocks carry it along with the target's.

Layers below `first_k_dense_replace` have a dense SwiGLU FFN, the rest a MoE. Module
and parameter names are the hub's (`model.layers.3.mlp.experts.7.up_proj.weight`, ...),
so a checkpoint's tensors map onto `state_dict()` one to one (kvtier.engine.weights).

`forward(batch, kv_pool)` runs one step for the flat new tokens of several sequences
(kvtier.engine.batch.StepBatch) and returns the logits of the rows in logits_index.
The KV of every layer lives only in `kv_pool` ([slots, layers, block_tokens,
kv_lora_rank + rope_dim]); `kv_layout()` says what its bytes mean.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.batch import StepBatch
from kvtier.engine.config import ModelConfig
from kvtier.engine.model.mla import MLA
from kvtier.engine.model.mlp import MLP
from kvtier.engine.model.moe import MoE
from kvtier.engine.model.norm import MLA_NORM_EPS, RMSNorm
from kvtier.engine.model.rope import RotaryEmbedding
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVLayout, dtype_name

# Bump when this engine changes what it writes into the cache for the same config and weights.
KV_FORMAT = "kvtier-mla1"

# Config fields that cannot change a cached byte (token ids, the checkpoint's storage dtype).
_NOT_IN_KV = {"bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "kvtier_model_type",
              "architectures", "quantization_config", "tie_word_embeddings", "num_nextn_predict_layers"}


def kv_variant(config: ModelConfig, compute_dtype: torch.dtype) -> str:
    """Everything besides the layout's shape that fixes what the cached bytes mean.

    - rope order: the rope key is stored rotated in the checkpoint's own element order,
      "pairs" (x0,x1),(x2,x3).. when rope_interleave, else "halves" (no de-interleave);
    - the latent norm's eps (1e-6, fixed upstream, not rms_norm_eps);
    - the compute dtype (bf16 and fp32 compute give different latents even when stored in bf16);
    - a digest of every config field that changes the numbers (rope theta and YaRN,
      router, widths, ...): two configs that compute different KV never share blocks.
    Different weights are told apart by the kvtier Namespace's model/revision, not here.
    """
    fields = {k: v for k, v in config.to_hf().items() if k not in _NOT_IN_KV}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    rope = "pairs" if config.rope_interleave else "halves"
    return f"{KV_FORMAT};rope={rope};latent_eps={MLA_NORM_EPS:g};compute={dtype_name(compute_dtype)};cfg={digest}"


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = MLA(config, layer)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
                kv_pool: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, kv_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    """The MTP layer's output: a norm and its own copy of the vocabulary projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module, stored as layer N: the target's hidden state
    at position i and the embedding of token i + 1, each RMS-normed, concatenated and projected
    (eh_proj), then one decoder block; shared_head turns the result into logits for token i + 2."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)


class Decoder(nn.Module):
    """The hub's `model.` prefix: embed_tokens, layers (then the MTP layer, when built), norm."""

    def __init__(self, config: ModelConfig, mtp: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        n = config.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(n)] + ([MTPLayer(config, n)] if mtp else []))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3(nn.Module):
    """The model. Build it with `load_model(...)`, or from a config and a hub-named state dict."""

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 random_weights: bool = False, source: str = "", mtp: bool = False) -> None:
        super().__init__()
        self.config = config
        if mtp and config.num_nextn_predict_layers < 1:
            raise ConfigError("this model has no next-token-prediction (MTP) layer: num_nextn_predict_layers is 0 "
                              "in its config")
        self.num_layers = config.num_hidden_layers          # the target's layers; the MTP layer comes after
        self.kv_layers = self.num_layers + int(mtp)         # layers of KV in each page
        self.random_weights = random_weights      # True: made from a seed, not a trained checkpoint
        self.source = source                      # the checkpoint path, or "random(seed=...)"
        with torch.device("meta"):                # no memory until the real tensors are assigned
            self.model = Decoder(config, mtp)
            self.lm_head = (None if config.tie_word_embeddings
                            else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        dtype = dtype or config.dtype
        device = torch.device(device) if device is not None else next(iter(state.values())).device
        check_state(config, state, hub_shapes_of(self))
        self.load_state_dict({k: _cast(k, t, dtype, device) for k, t in state.items()}, strict=True, assign=True)
        self.rotary = RotaryEmbedding(config).to(device)
        self.eval().requires_grad_(False)
        for layer in self.model.layers:          # speed: weights read by one input concatenated
            layer.self_attn.fuse()               # (views, no extra memory; see each fuse())
            layer.mlp.fuse()
        if device.type == "cpu":
            keep_freed_cpu_memory()

    @classmethod
    def skeleton(cls, config: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
        """The hub's tensor names and shapes for this config (built on the meta device, no memory);
        with mtp, the MTP layer's too."""
        with torch.device("meta"):
            m = nn.Module()
            m.model = Decoder(config, mtp)
            if not config.tie_word_embeddings:
                m.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        return hub_shapes_of(m)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def kv_layout(self, block_tokens: int, dtype: torch.dtype | None = None) -> KVLayout:
        """The kvtier layout of this model's paged KV (dtype: the pool's, default the model's)."""
        c = self.config
        variant = kv_variant(c, self.dtype) + (";mtp=1" if self.kv_layers > self.num_layers else "")
        return KVLayout.mla(self.kv_layers, c.kv_lora_rank, c.qk_rope_head_dim, block_tokens,
                            dtype or self.dtype, variant=variant)

    @torch.no_grad()
    def forward(self, batch: StepBatch, kv_pool: torch.Tensor,
                hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [len(batch.logits_index), vocab] (fp32); writes the new tokens' KV into kv_pool.
        hidden=True: (logits, the final-normed hidden state of every new token), what the MTP layer reads."""
        self._check(batch, kv_pool)
        h = self.model.embed_tokens(batch.input_ids.to(self.device))
        cos, sin = self.rotary(batch.positions.to(self.device))
        for i in range(self.num_layers):
            if batch.before_layer is not None:
                batch.before_layer(i)             # layer i's cached pages are in place from here on
            h = self.model.layers[i](h, cos, sin, batch, kv_pool)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if hidden:                                # speed: every row normed only when the MTP layer needs them
            h = self.model.norm(h)
            return F.linear(h[batch.logits_index.to(self.device)], head).float(), h
        h = self.model.norm(h[batch.logits_index.to(self.device)])
        return F.linear(h, head).float()

    @torch.no_grad()
    def forward_mtp(self, batch: StepBatch, kv_pool: torch.Tensor,
                    previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a batch whose token at position i is token i + 1, with `previous`
        the hidden state at each position (the target's, or this layer's own output when it
        runs ahead): (logits of the logits_index rows, fp32; its output hidden states, for the
        next position). Writes its KV into layer N of kv_pool."""
        self._check(batch, kv_pool)
        mtp = self.model.layers[self.num_layers]
        assert isinstance(mtp, MTPLayer), "built without mtp=True"
        pos = batch.positions.to(self.device)
        e = mtp.embed_tokens(batch.input_ids.to(self.device))
        e = torch.where(pos[:, None] == 0, 0.0, e)   # as vLLM's DeepSeek MTP: no embedding at position 0
        x = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(previous.to(e.dtype))], dim=-1))
        cos, sin = self.rotary(pos)
        x = mtp(x, cos, sin, batch, kv_pool)
        out = mtp.shared_head.norm(x[batch.logits_index.to(self.device)])
        return mtp.shared_head.head(out).float(), x

    def _check(self, batch: StepBatch, kv_pool: torch.Tensor) -> None:
        c = self.config
        want = (self.kv_layers, c.kv_entry_dim)
        if kv_pool.dim() != 4 or (kv_pool.shape[1], kv_pool.shape[3]) != want or not kv_pool.is_floating_point() \
                or not kv_pool.is_contiguous():                  # attention reads it as flat rows
            raise LayoutError(f"kv_pool must be a contiguous float tensor [slots, {want[0]}, block_tokens, {want[1]}] "
                              f"(KVLayout from model.kv_layout()), got {kv_pool.dtype} {tuple(kv_pool.shape)}")
        t = batch.input_ids.shape[0]
        if batch.input_ids.dim() != 1 or batch.positions.shape != batch.input_ids.shape:
            raise ConfigError(f"input_ids and positions must be 1-D and the same length, got "
                              f"{tuple(batch.input_ids.shape)} and {tuple(batch.positions.shape)}")
        block_tokens = kv_pool.shape[2]
        for s in batch.seqs:
            if s.start < 0 or s.num_new <= 0 or s.context < 0 or s.start + s.num_new > t:
                raise ConfigError(f"bad SeqSlice(start={s.start}, num_new={s.num_new}, context={s.context}) "
                                  f"for a batch of {t} tokens")
            if s.pages.numel() * block_tokens < s.total:
                raise LayoutError(f"a sequence of {s.total} tokens needs {-(-s.total // block_tokens)} pages "
                                  f"of {block_tokens} tokens, got {s.pages.numel()}")


def keep_freed_cpu_memory() -> None:
    """Speed, CPU only: tell glibc's malloc to keep freed memory for reuse.

    Each step allocates the same large temporaries (a layer's gathered key rows, prefill
    activations: megabytes). By default glibc hands blocks that large back to the OS when
    they are freed (mmap/munmap, heap trimming), so the next step faults them back in a 4 KiB
    page at a time; measured here that cost more than the attention itself (batch-16 decode
    +20-70% tokens/s, first token of a 1k prompt 15-25% sooner with this). Cost: the process
    keeps up to its peak of freed memory mapped, as torch's CUDA caching allocator does on
    a GPU. Process-wide, once, glibc only (elsewhere a no-op); KVTIER_KEEP_FREED_MEMORY=0
    leaves malloc alone (vLLM's CPU docs reach the same end by preloading tcmalloc).
    """
    global _KEPT
    if _KEPT or os.environ.get("KVTIER_KEEP_FREED_MEMORY", "1") == "0":
        return
    _KEPT = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3              # glibc's mallopt parameters
        libc.mallopt(m_trim_threshold, 1 << 30)                  # trim the heap only past 1 GiB free
        libc.mallopt(m_mmap_threshold, 1 << 30)                  # serve blocks under 1 GiB from the heap
    except (OSError, AttributeError):                            # not glibc: nothing to tune
        pass


_KEPT = False


def hub_shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def check_state(config: ModelConfig, state: Mapping[str, torch.Tensor],
                expected: dict[str, tuple[int, ...]]) -> None:
    """ConfigError naming the first missing, unexpected or misshaped tensor."""
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"checkpoint lacks tensor {missing[0]}{more}: it does not match this config "
                          f"({config.num_hidden_layers} layers, {config.n_routed_experts} experts)")
    extra = [k for k in state if k not in expected]
    if extra:
        raise ConfigError(f"checkpoint has unexpected tensor {extra[0]}: it does not match this config")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise ConfigError(f"tensor {k} has shape {tuple(state[k].shape)}, this config expects {shape}")


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The router's correction bias stays fp32: it only ranks scores that differ in late digits.
    want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
    return t.to(device=device, dtype=want)
