"""Plug kvtier into inference engines that own their KV pages (vLLM: `kvtier.integrations.vllm`)."""
