"""Request traces: the Mooncake and token-level JSONL readers (detected from the file)
and a deterministic agentic generator, all reduced to one Trace of keyed Requests."""
from __future__ import annotations

from kvtier.errors import TraceError
from kvtier.traces.model import Request, Trace
from kvtier.traces.read import detect_format, read_trace

_SYNTHETIC = ("AgenticConfig", "generate", "synthetic_name", "synthetic_trace", "write_trace")


def __getattr__(name: str) -> object:
    """The generator's names, imported when first used: `python -m kvtier.traces.synthetic`
    then runs a module not imported yet (runpy warned twice on every run otherwise)."""
    if name in _SYNTHETIC:
        from kvtier.traces import synthetic
        return getattr(synthetic, name)
    raise AttributeError(f"module 'kvtier.traces' has no attribute {name!r}")

__all__ = ["AgenticConfig", "Request", "Trace", "TraceError", "detect_format", "generate",
           "read_trace", "synthetic_name", "synthetic_trace", "write_trace"]
