"""`load_model`: a ready model from a preset name or a checkpoint directory, and what it is.

The ModelInfo says where the weights came from (random from a seed, or a checkpoint),
which kvtier Namespace its cached KV belongs to (model + revision: different weights
never share blocks), and where its tokenizer lives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.engine.config import PRESET_GPU_ONLY, PRESET_RANDOM_WEIGHTS, ModelConfig, preset, preset_names
from kvtier.engine.model.model import DeepseekV3
from kvtier.errors import ConfigError
from kvtier.layout import dtype_from_name, dtype_name
from kvtier.keys import Namespace, checkpoint_revision



@dataclass(frozen=True)
class ModelInfo:
    name: str                     # the preset name, or the checkpoint directory's name
    source: str                   # "preset kimi-tiny", or the checkpoint directory
    revision: str                 # "random-seed0", or a digest of the checkpoint's files
    random_weights: bool          # True: made from a seed, not trained (its output is noise)
    tokenizer_path: str | None    # the checkpoint directory; None: a preset (byte-level tokenizer)
    dtype: torch.dtype

    def namespace(self, salt: bytes = b"", shard: str = "") -> Namespace:
        """The kvtier namespace of this model's cached KV."""
        return Namespace(model=self.name, revision=self.revision, shard=shard, salt=salt)

    def describe(self) -> str:
        weights = "random weights" if self.random_weights else "checkpoint weights"
        return f"{self.name} ({weights}, {self.revision}, {str(self.dtype).replace('torch.', '')}) from {self.source}"


def compute_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """The dtype to compute in: the given one (a dtype or a name like "bf16"), else the config's."""
    if dtype is None:
        return config.dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or their names), "
                              f"got {dtype}")
        return dtype
    return dtype_from_name(dtype, ("float32", "bfloat16", "float16"))


def _gib(config: ModelConfig, dtype: torch.dtype) -> float:
    """The model's weights in GiB at `dtype`."""
    n = sum(math.prod(shape) for shape in DeepseekV3.skeleton(config).values())
    return n * torch.empty(0, dtype=dtype).element_size() / 2**30


def load_model(source: str | Path | ModelConfig, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, seed: int = 0,
               mtp: bool = False) -> tuple[DeepseekV3, ModelInfo]:
    """(model, info) from a preset with random weights ("kimi-tiny"), a ModelConfig (random
    weights of that shape), or a Hugging Face checkpoint directory. dtype defaults to the
    config's torch_dtype (float32 for kimi-tiny, bfloat16 for real checkpoints); device to
    CUDA when there is one. mtp=True also builds the first next-token-prediction layer
    (the config must have num_nextn_predict_layers >= 1)."""
    from kvtier.engine import weights

    from kvtier.tiers.device import resolve_device

    device = resolve_device(device)    # cuda when present; a ConfigError for a device this machine lacks
    if isinstance(source, ModelConfig) or (isinstance(source, str) and source in preset_names()):
        if isinstance(source, str) and source not in PRESET_RANDOM_WEIGHTS:
            raise ConfigError(f"preset {source!r} names a real model whose weights are not shipped: pass its "
                              f"checkpoint directory, or load_model(preset({source!r})) for random weights "
                              "of that shape (it needs that model's memory)")
        config = preset(source) if isinstance(source, str) else source
        name = source if isinstance(source, str) else f"random-{config.model_type}"
        dt = compute_dtype(dtype, config)
        revision = f"random-seed{seed}"
        if name in PRESET_GPU_ONLY:
            if device.type != "cuda":
                raise ConfigError(f"preset {name!r} is for a GPU (its random weights are drawn there: "
                                  f"{_gib(config, dt):.1f} GiB in {dtype_name(dt)}); on a CPU use kimi-tiny")
            if mtp:
                raise ConfigError(f"preset {name!r} has no MTP layer: use method \"ngram\" or \"draft_model\"")
            state = weights.random_weights(config, seed=seed, dtype=dt, device=device)
            revision += f"-{device.type}"         # another generator, other weights: never the CPU's blocks
        else:
            state = weights.random_weights(config, seed=seed, mtp=mtp)
        model = DeepseekV3(config, state, dtype=dt, device=device, random_weights=True,
                           source=f"random(seed={seed})", mtp=mtp)
        del state
        info = ModelInfo(name, f"preset {name}", revision, True, None, dt)
    else:
        path = Path(source)
        if not path.is_dir():
            why = "is a file, not a folder" if path.exists() else "does not exist"
            raise ConfigError(f"{str(source)!r} is neither a model preset ({', '.join(preset_names())}) nor a "
                              f"checkpoint directory: that path {why}")
        config = ModelConfig.from_hf(path)
        dt = compute_dtype(dtype, config)
        if mtp and config.num_nextn_predict_layers < 1:
            raise ConfigError(f"{path} has no next-token-prediction (MTP) layer (num_nextn_predict_layers is 0): "
                              "use method \"ngram\" or \"draft_model\"")
        state = weights.load_checkpoint(path, config, dtype=dt, device=device, mtp=mtp)
        model = DeepseekV3(config, state, dtype=dt, device=device, source=str(path), mtp=mtp)
        info = ModelInfo(path.resolve().name, str(path), checkpoint_revision(path), False, str(path), dt)
    model.info = info
    return model, info
