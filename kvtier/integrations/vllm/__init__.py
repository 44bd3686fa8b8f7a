"""kvtier as a vLLM v1 KV connector: vLLM loads cached prefixes from kvtier's tiers (host
memory, disk, other nodes) and saves new blocks to them.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_connector_extra_config={"host_capacity": "8GiB", "disk_path": "/nvme/kv"}))

`KvtierConnector` is imported on first use (it needs vLLM: `pip install 'kvtier[vllm]'`);
the configuration, layout and planning modules beside it do not import vLLM. See docs/vllm.md.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    # Lazy, so `kvtier.integrations.vllm.config` and friends import without vLLM installed;
    # vLLM's connector factory does getattr(module, "KvtierConnector"), which lands here.
    if name == "KvtierConnector":
        try:
            from kvtier.integrations.vllm.connector import KvtierConnector
        except ImportError as e:
            if "vllm" not in str(e):
                raise
            from kvtier.errors import ConfigError
            raise ConfigError(f"kvtier's vLLM connector needs vLLM ({e}): install it with "
                              "pip install torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu && "
                              "pip install 'kvtier[vllm]' (see docs/vllm.md)") from e
        return KvtierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
