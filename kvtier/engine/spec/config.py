"""SpeculativeConfig: which proposer, and how many tokens it may guess per step (vLLM's names)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvtier.errors import ConfigError

METHODS = ("ngram", "draft_model", "mtp")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method="ngram"` (prompt lookup): match the last n tokens, prompt_lookup_max >= n >=
    prompt_lookup_min, earlier in the prompt + output and propose the k tokens that followed.
    `method="draft_model"`: a smaller model with the same tokenizer (`model`: a preset name or a
    checkpoint directory) decodes k tokens ahead on its own paged KV.
    `method="mtp"`: the checkpoint's own next-token-prediction layer (DeepSeek-V3's
    `num_nextn_predict_layers`) proposes, reading the target's hidden states."""

    method: str = "ngram"
    num_speculative_tokens: int = 4        # k: tokens proposed (and verified) per decode step
    prompt_lookup_max: int = 4             # longest suffix n-gram tried first
    prompt_lookup_min: int = 1             # shortest suffix n-gram tried last
    model: str | None = None               # draft_model: the draft's preset name or checkpoint directory

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ConfigError("method \"draft_model\" needs \"model\": a preset name or a checkpoint directory "
                              "with the target's tokenizer")
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"\"model\" is for method \"draft_model\", not {self.method!r}")

    @classmethod
    def from_dict(cls, d: object) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"a speculative config is a JSON object like {{\"method\": \"ngram\", "
                              f"\"num_speculative_tokens\": 4}}, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown speculative config key(s) {', '.join(map(repr, unknown))}: "
                              f"use {', '.join(sorted(known))}")
        if "method" not in d:
            raise ConfigError(f"a speculative config needs \"method\" ({', '.join(map(repr, METHODS))})")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the speculative config is not valid JSON ({e}): give e.g. "
                              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'") from None
        return cls.from_dict(d)
