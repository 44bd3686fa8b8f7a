"""The hit-ratio replay (metadata only) and the real store (with payload) agree exactly.

Both are driven with the same agentic requests; the store serves each one as an engine
would (keys, lookup, get the hit, put the rest), the replay drives the same BlockIndex
calls with no bytes. Their per-request prefix hits must be identical.
"""
import pytest
import torch

import kvtier
import kvtier.store
from kvtier.sim.replay import replay
from kvtier.traces.model import Request, Trace
from kvtier.traces.synthetic import AgenticConfig, generate
from tests.conftest import payload

LAYOUT = kvtier.KVLayout.mha(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=256, dtype=torch.float16)


@pytest.mark.parametrize("capacity", [48, 160, 2000])
@pytest.mark.parametrize("policy", ["lru", "recommended"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["one-step", "pipelined"])
def test_store_and_replay_see_the_same_hits(capacity, policy, pipelined, monkeypatch):
    if pipelined:   # every put of 8+ blocks is reserved in two steps (store.py, _store)
        monkeypatch.setattr(kvtier.store, "PIPELINE_HEAD_BYTES", 4 * LAYOUT.block_bytes)
    cfg = AgenticConfig(seed=3, sessions=12, mean_turns=5, max_context=16384, session_rate=2.0,
                        block_tokens=LAYOUT.block_tokens)
    requests = generate(cfg)
    assert len(requests) > 30
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=capacity)], kvtier.Namespace("equivalence"),
                         policy=policy)
    trace_requests, store_hits = [], []
    out = torch.empty(0, LAYOUT.block_bytes, dtype=torch.uint8)
    for r in requests:
        keys = store.keys(r.tokens)
        keys = keys[:capacity]                      # a put larger than the tier is refused
        hit = store.lookup(keys)
        if hit.blocks:
            if len(out) < hit.blocks:
                out = torch.empty(hit.blocks, LAYOUT.block_bytes, dtype=torch.uint8)
            store.get(keys[:hit.blocks], out[:hit.blocks])
            assert torch.equal(out[:hit.blocks], payload(keys[:hit.blocks], LAYOUT.block_bytes))
        store.put(keys[hit.blocks:], payload(keys[hit.blocks:], LAYOUT.block_bytes))
        store_hits.append(hit.blocks)
        trace_requests.append(Request(keys=list(keys), input_length=len(keys) * LAYOUT.block_tokens))
    trace = Trace("agentic", trace_requests, LAYOUT.block_tokens)
    result = replay(trace, policy, capacity)
    assert sum(store_hits) > 0
    assert (store.stats().tiers[0].evicted > 0) == (capacity < 2000)
    assert result.hits == store_hits
    assert result.evictions == store.stats().tiers[0].evicted
