"""Weights in Hugging Face hub layout: load a checkpoint, make random ones, save one.

A checkpoint directory holds config.json and *.safetensors shards (listed by
model.safetensors.index.json when there are several). Tensor names are the hub's:

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
                                kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}.weight
    model.layers.{i}.mlp.{gate_proj, up_proj, down_proj}.weight              (dense layers)
    model.layers.{i}.mlp.gate.weight, model.layers.{i}.mlp.gate.e_score_correction_bias
    model.layers.{i}.mlp.experts.{j}.{gate_proj, up_proj, down_proj}.weight  (one per expert)
    model.layers.{i}.mlp.shared_experts.{gate_proj, up_proj, down_proj}.weight

    model.layers.{N}.{enorm, hnorm, eh_proj, embed_tokens, shared_head.norm, shared_head.head}.weight
        and one decoder block's tensors under model.layers.{N}.: the first multi-token-prediction
        (MTP) layer, N = num_hidden_layers, where num_nextn_predict_layers >= 1

Loading memory-maps each shard (safetensors.safe_open) and copies one tensor at a time
to the target device and dtype. Layers at index >= num_hidden_layers (DeepSeek-V3's
multi-token-prediction layer) are skipped unless `mtp=True` asks for the first of them. FP8 block-quantized checkpoints (DeepSeek-V3
and Kimi K2 as published: float8_e4m3fn weights plus `<name>_scale_inv`, one scale per
weight_block_size block) are dequantized to the compute dtype at load time.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch

from kvtier.engine.config import ModelConfig
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def hub_shapes(config: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of this config holds, with its shape, in model order
    (with mtp, the first MTP layer's tensors too)."""
    from kvtier.engine.model.model import DeepseekV3
    return DeepseekV3.skeleton(config, mtp)


def mtp_prefix(config: ModelConfig) -> str:
    """Where the first MTP layer's tensors are: model.layers.{num_hidden_layers}."""
    return f"model.layers.{config.num_hidden_layers}."


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - depends on the install
        raise ConfigError("loading a checkpoint needs safetensors: pip install 'kvtier[engine]'") from None
    return safe_open


def _open_shard(stack: ExitStack, safe_open, f: Path):
    """One shard, opened (memory-mapped) for the rest of `stack`; a damaged file is named."""
    from safetensors import SafetensorError
    try:
        return stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
    except SafetensorError as e:
        raise ConfigError(f"{f} is damaged or not a safetensors file ({e}): download it again") from None


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            if not isinstance(weight_map, dict):
                raise ValueError("its weight_map is not an object")
        except (ValueError, AttributeError) as e:   # not JSON, not UTF-8, not an object
            raise ConfigError(f"{index} is damaged or not a safetensors index ({e}): download it again") from None
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"{index} lists shard {absent[0]}, which is not in {path}: finish the download")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}: pass a Hugging Face checkpoint directory")
    return files


def _fp8_block(config: ModelConfig) -> tuple[int, int] | None:
    q = config.quantization_config
    if q is None:
        return None
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConfigError(f"quantization {q.get('quant_method')!r} (config {q}) is not supported: the engine "
                          "loads bf16/fp16/fp32 checkpoints and block-wise FP8 ones (quant_method 'fp8' with "
                          "weight_block_size); convert the checkpoint to bf16 first")
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight (fp8) * scale_inv, one scale per [block[0], block[1]] tile (the last tiles may be partial)."""
    rows, cols = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * s


def load_checkpoint(path: str | Path, config: ModelConfig | None = None, *, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu", mtp: bool = False) -> dict[str, torch.Tensor]:
    """The hub-named tensors of a checkpoint directory, in `dtype` (default: config.torch_dtype) on
    `device`; with mtp, the first MTP layer's too."""
    path = Path(path)
    config = config or ModelConfig.from_hf(path)
    dtype = dtype or config.dtype
    block = _fp8_block(config)
    expected = hub_shapes(config, mtp)
    safe_open = _safe_open()
    state: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for f in _shard_files(path):
            sf = _open_shard(stack, safe_open, f)
            for name in sf.keys():
                where[name] = sf
        skipped = 0
        for name, sf in where.items():
            if name in expected:
                continue
            m = _LAYER.match(name)
            if (m and int(m.group(1)) >= config.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
                skipped += 1                      # MTP layers, stale rope buffers: not part of this model
            elif block and name.endswith("_scale_inv") and name[:-len("_scale_inv")] in expected:
                continue
            else:
                raise ConfigError(f"checkpoint {path} has unexpected tensor {name}: it does not match "
                                  f"its config ({config.num_hidden_layers} layers, {config.n_routed_experts} "
                                  "experts)")
        if skipped:
            log.info("%s: skipped %d tensors of layers >= %d (multi-token prediction) or rope buffers",
                     path, skipped, config.num_hidden_layers)
        for name, shape in expected.items():
            if name not in where:
                raise ConfigError(f"checkpoint {path} lacks tensor {name}: the download is incomplete or "
                                  "it is not a checkpoint of this config")
            t = where[name].get_tensor(name)
            if tuple(t.shape) != shape:
                raise ConfigError(f"tensor {name} has shape {tuple(t.shape)} in {path}, the config expects {shape}")
            if t.dtype in _FP8:
                scale = name + "_scale_inv"
                if block is None or scale not in where:
                    raise ConfigError(f"tensor {name} is FP8 but the checkpoint has no {scale} or no "
                                      "quantization_config.weight_block_size to dequantize it with")
                t = dequantize_fp8(t, where[scale].get_tensor(scale), block)
            want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
            state[name] = t.to(device=device, dtype=want)
    return state


def random_weights(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                   std: float = 0.1, bias_std: float = 0.05, mtp: bool | None = None,
                   device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Deterministic random weights from `seed`: matrices N(0, std), norms 1, router correction
    bias N(0, bias_std) (non-zero so it visibly steers expert selection). std is wider than
    HF's 0.02 init: at 0.02 a random kimi-tiny's attention is nearly uniform and greedy decoding
    repeats one token, so cached-vs-uncached comparisons would prove little; at 0.1 it varies.
    Drawn in fp32 in model order, then cast: the same seed gives the same model in any dtype.
    With an MTP layer (mtp, default: when config.num_nextn_predict_layers >= 1) its tensors are
    drawn after the model's, so the model is the same with or without it; its embed_tokens and
    shared_head.head copy the model's, as DeepSeek-V3 shares them.

    With `device` (a GPU, for presets too large to draw on a CPU: kimi-medium) the weights are
    drawn there by its generator, straight in `dtype`: the same seed gives the same weights on
    that kind of device, not the CPU's."""
    if device is not None:
        return _random_on(torch.device(device), config, seed, dtype, std, bias_std)
    g = torch.Generator().manual_seed(seed)
    state = {}
    shapes = hub_shapes(config)
    with_mtp = config.num_nextn_predict_layers >= 1 if mtp is None else mtp
    if with_mtp:
        shapes.update({k: v for k, v in hub_shapes(config, True).items() if k not in shapes})
    pre = mtp_prefix(config)
    for name, shape in shapes.items():
        if name == pre + "embed_tokens.weight":
            state[name] = state["model.embed_tokens.weight"].clone()
            continue
        if name == pre + "shared_head.head.weight":
            state[name] = state["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"].clone()
            continue
        if name.endswith(("layernorm.weight", "norm.weight")) or name == "model.norm.weight":
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.randn(shape, generator=g) * bias_std
        else:
            t = torch.randn(shape, generator=g) * std
        state[name] = t if name.endswith("e_score_correction_bias") else t.to(dtype)
    return state


def _random_on(device: torch.device, config: ModelConfig, seed: int, dtype: torch.dtype, std: float,
               bias_std: float) -> dict[str, torch.Tensor]:
    """random_weights drawn on `device` in `dtype` (no MTP layer), in model order."""
    g = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, shape in hub_shapes(config).items():
        if name.endswith(("layernorm.weight", "norm.weight")) or name == "model.norm.weight":
            state[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith("e_score_correction_bias"):       # fp32, as the model keeps it
            state[name] = torch.randn(shape, generator=g, device=device).mul_(bias_std)
        else:
            state[name] = torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(std)
    return state


def save_checkpoint(path: str | Path, config: ModelConfig, state: Mapping[str, torch.Tensor],
                    max_shard_bytes: int = 2 << 30) -> None:
    """Write config.json and safetensors shards in hub layout (one tensor per expert), with an
    index when there are several shards: our loader and transformers' from_pretrained read it."""
    from kvtier.engine.model.model import check_state
    try:
        from safetensors.torch import save_file
    except ImportError:  # pragma: no cover
        raise ConfigError("saving a checkpoint needs safetensors: pip install 'kvtier[engine]'") from None
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    expected = hub_shapes(config, any(k.startswith(mtp_prefix(config)) for k in state))
    check_state(config, state, expected)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in expected:
        t = state[name].detach().to("cpu").contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    # the tensors written are plain floats, whatever quantization the source checkpoint had
    hf = config.replace(quantization_config=None).to_hf()
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
