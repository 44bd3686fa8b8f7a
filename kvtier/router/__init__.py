"""`kvtier router`: an OpenAI-compatible front over prefill and decode workers
(`kvtier serve --role ...`), routing by tokens and cached prefixes (docs/disaggregation.md)."""
