"""Request traces: the Mooncake and token-level JSONL readers (detected from the file)
and a deterministic agentic generator, all reduced to one Trace of keyed Requests."""
from __future__ import annotations

from kvtier.errors import TraceError
from kvtier.traces.model import Request, Trace
from kvtier.traces.read import detect_format, read_trace
from kvtier.traces.synthetic import AgenticConfig, generate, synthetic_trace, write_trace

__all__ = ["AgenticConfig", "Request", "Trace", "TraceError", "detect_format", "generate",
           "read_trace", "synthetic_trace", "write_trace"]
