"""The reference Kimi-class engine: DeepSeek-V3 architecture (MLA + MoE) over kvtier.

    from kvtier.engine import LLM, SamplingParams
    llm = LLM("kimi-tiny")                       # random weights, byte-level tokenizer, CPU
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Folders follow the data: scheduler.py (1. schedule: prefix lookup and load), runner.py
(2. prepare, 3. run), llm.py (4. postprocess: sample, save, finish), model/ (the network).
The store whose device tier is the KV pages is built from a kvtier.StoreConfig.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:   # lazy: `import kvtier.engine.sampling` stays light
    if name in ("LLM", "RequestOutput"):
        from kvtier.engine import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from kvtier.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'kvtier.engine' has no attribute {name!r}")
