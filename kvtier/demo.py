"""`kvtier demo`: an agent's turns through the store, end to end, on embedded defaults.

Several sessions share a system prompt and tool definitions and grow their conversation
turn by turn. Each turn keys its prompt, looks up the cached prefix, loads it, "computes"
the rest (deterministic stand-in KV derived from the key, so every load is checked
byte for byte), and saves the new blocks.
"""
from __future__ import annotations

import argparse

HELP = "run agent sessions through a store and show the prefix hits (embedded defaults)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=4, help="concurrent agent sessions (default 4)")
    p.add_argument("--turns", type=int, default=5, help="turns per session (default 5)")
    p.add_argument("--capacity", default="1GiB", help="host tier capacity (default 1GiB)")
    p.add_argument("--layout", default="kimi-k2", help="layout preset (default kimi-k2)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the final stats as JSON")


def fake_kv(keys: list[bytes], block_bytes: int):
    """Stand-in KV for `keys`: bytes that depend only on each key, so loads can be checked."""
    import numpy as np
    import torch

    out = np.empty((len(keys), block_bytes // 16, 16), dtype=np.uint8)   # presets are 16-byte multiples
    for i, k in enumerate(keys):
        out[i] = np.frombuffer(k, dtype=np.uint8)   # the key, tiled over the block
    return torch.from_numpy(out.reshape(len(keys), block_bytes))


def run(args: argparse.Namespace) -> int:
    import json

    import numpy as np
    import torch

    from kvtier.bench.common import quiet_threads
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.layout import preset_layout
    from kvtier.store import Store
    from kvtier.tiers import HostTier
    from kvtier.units import format_bytes

    if args.sessions < 1 or args.turns < 1:
        raise ConfigError("--sessions and --turns must be at least 1")
    quiet_threads()
    layout = preset_layout(args.layout, args.block_tokens)
    store = Store(layout, [HostTier(capacity=args.capacity)], Namespace(model=args.layout, revision="demo"))
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, 150_000, 1200).tolist()      # system prompt + tool definitions
    history = {s: list(system) for s in range(args.sessions)}
    print(f"kvtier demo: {args.sessions} agent sessions x {args.turns} turns; layout {layout.describe()}")
    print(f"host tier {args.capacity}: {store.stats().tiers[0].capacity_blocks} blocks, "
          f"{store.stats().tiers[0].info.get('memory_note', '')}")
    total_tokens = hit_tokens = 0
    load_buf = torch.zeros(0, layout.block_bytes, dtype=torch.uint8)   # reused: fresh memory faults slowly
    for turn in range(args.turns):
        turn_tokens = turn_hits = 0
        for s in range(args.sessions):
            history[s] += rng.integers(0, 150_000, int(rng.integers(100, 300))).tolist()  # user + tool output
            tokens = history[s]
            keys = store.keys(tokens)
            hit = store.lookup(keys)
            if hit.blocks:
                if len(load_buf) < hit.blocks:
                    load_buf = torch.zeros(2 * hit.blocks, layout.block_bytes, dtype=torch.uint8)
                out = load_buf[:hit.blocks]
                store.get(keys[:hit.blocks], out)
                if not torch.equal(out, fake_kv(keys[:hit.blocks], layout.block_bytes)):
                    raise AssertionError("loaded KV differs from what was saved")
            store.put(keys[hit.blocks:], fake_kv(keys[hit.blocks:], layout.block_bytes))
            store.pin(f"session-{s}", keys, ttl=600)
            history[s] += rng.integers(0, 150_000, int(rng.integers(50, 200))).tolist()  # the reply
            turn_tokens += len(tokens)
            turn_hits += hit.tokens
        total_tokens += turn_tokens
        hit_tokens += turn_hits
        print(f"turn {turn + 1}: {turn_hits:>7} of {turn_tokens:>7} prompt tokens from cache "
              f"({turn_hits / turn_tokens:6.1%}), every load verified")
    st = store.stats()
    t = st.tiers[0]
    print(f"total: {hit_tokens / total_tokens:.1%} of prompt tokens not recomputed; host tier holds "
          f"{t.used_blocks} blocks ({format_bytes(t.used_bytes)}), {t.evicted} evicted, "
          f"pinned {format_bytes(t.pinned_bytes)} for {st.pinned_sessions} sessions")
    if args.json:
        print(json.dumps(st.as_dict()))
    store.close()
    return 0
