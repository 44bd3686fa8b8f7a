"""pytest plugin: every LLM built without `speculative=` gets n-gram speculation (k=4), so
any engine test file runs with it on: `pytest tests/test_engine.py -p tests.spec_on`."""
from __future__ import annotations

import functools

from kvtier.engine.llm import LLM
from kvtier.engine.spec import SpeculativeConfig

_init = LLM.__init__


@functools.wraps(_init)
def _with_spec(self, *args, **kw):
    kw.setdefault("speculative", SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    _init(self, *args, **kw)


LLM.__init__ = _with_spec
