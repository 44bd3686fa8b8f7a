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
    from kvtier.argtypes import non_negative_int, positive_int, size
    from kvtier.presets import LAYOUT_PRESETS as PRESETS

    p.add_argument("--sessions", type=positive_int, default=4, metavar="N", help="concurrent agent sessions (default 4)")
    p.add_argument("--turns", type=positive_int, default=5, metavar="N", help="turns per session (default 5)")
    p.add_argument("--capacity", type=size, default=1 << 30, metavar="SIZE",
                   help="host tier capacity, e.g. 512MiB; at least one block (default 1GiB)")
    p.add_argument("--layout", default="kimi-k2", choices=list(PRESETS),
                   help=f"KV layout preset: {', '.join(PRESETS)} (default kimi-k2)")
    p.add_argument("--block-tokens", type=positive_int, default=16, metavar="N", help="tokens per block (default 16)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="N",
                   help="seed of the generated conversations (default 0)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the text: per-turn hits, whether every load "
                        "was verified, and the store's stats")


def fake_kv(keys: list[bytes], block_bytes: int):
    """Stand-in KV for `keys`: bytes that depend only on each key, so loads can be checked."""
    import numpy as np
    import torch

    out = np.empty((len(keys), block_bytes // 16, 16), dtype=np.uint8)   # presets are 16-byte multiples
    for i, k in enumerate(keys):
        out[i] = np.frombuffer(k, dtype=np.uint8)   # the key, tiled over the block
    return torch.from_numpy(out.reshape(len(keys), block_bytes))


# What the demo keeps per session besides the store: its conversation as a list of token ids
# (a 1,200-token system prompt shared, then ~400 tokens a turn at ~40 bytes a Python int).
SYSTEM_TOKENS, TURN_BYTES = 1200, 400 * 40


# The demo is a few minutes' illustration: about 6 requests a second here (160 sessions x 5
# turns took 133 s), so past this bound a run would take hours (100,000 sessions: a day).
MAX_REQUESTS = 10_000


def _check_size(sessions: int, turns: int) -> None:
    """Refuse, before building them, conversations this machine's memory cannot hold, or too
    many requests for a demonstration."""
    from kvtier.errors import ConfigError
    from kvtier.tiers.memory import memory_available
    from kvtier.units import format_bytes

    need = sessions * (SYSTEM_TOKENS * 8 + turns * TURN_BYTES)
    avail, _ = memory_available()
    if avail is not None and need > avail / 2:
        raise ConfigError(f"{sessions:,} sessions x {turns:,} turns keep about {format_bytes(need)} of conversation "
                          f"in memory, more than half of the {format_bytes(avail)} available: give fewer --sessions "
                          "or --turns")
    if sessions * turns > MAX_REQUESTS:
        raise ConfigError(f"--sessions {sessions:,} x --turns {turns:,} is {sessions * turns:,} requests; the demo "
                          f"takes at most {MAX_REQUESTS:,} (about 6 a second here): give fewer, or replay a long "
                          "trace with `kvtier bench hit-ratio`")


def run(args: argparse.Namespace) -> int:
    import json

    import numpy as np
    import torch

    from kvtier.bench.common import quiet_threads
    from kvtier.errors import CapacityError, ConfigError, KvtierError
    from kvtier.keys import Namespace
    from kvtier.layout import preset_layout
    from kvtier.progress import progress
    from kvtier.store import Store
    from kvtier.tiers import HostTier
    from kvtier.units import format_bytes

    layout = preset_layout(args.layout, args.block_tokens)
    if args.capacity < layout.block_bytes:
        raise ConfigError(f"--capacity {format_bytes(args.capacity)} is smaller than one block of {args.layout} "
                          f"at --block-tokens {args.block_tokens} ({format_bytes(layout.block_bytes)}): give at "
                          "least that much (the default 1GiB runs the default sessions and turns)")
    _check_size(args.sessions, args.turns)
    quiet_threads()
    show = not args.json

    def say(text: str) -> None:
        if show:
            print(text)

    store = Store(layout, [HostTier(capacity=args.capacity)], Namespace(model=args.layout, revision="demo"))
    try:
        tier0 = store.stats().tiers[0]
        say(f"kvtier demo: {args.sessions} agent sessions x {args.turns} turns; layout {layout.describe()}")
        say(f"host tier {format_bytes(args.capacity)}: {tier0.capacity_blocks} blocks, "
            f"{tier0.info.get('memory_note', '')}")
        rng = np.random.default_rng(args.seed)
        system = rng.integers(0, 150_000, 1200).tolist()      # system prompt + tool definitions
        history = {s: list(system) for s in range(args.sessions)}
        turns = []
        load_buf = torch.zeros(0, layout.block_bytes, dtype=torch.uint8)   # reused: fresh memory faults slowly
        with progress("demo", args.sessions * args.turns, enabled=show) as bar:
            for turn in range(args.turns):
                bar.describe(f"turn {turn + 1} of {args.turns}")
                turn_tokens = turn_hits = verified = 0
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
                            raise KvtierError(f"turn {turn + 1}, session {s}: the KV loaded from the store differs "
                                              "from what was saved (a bug in kvtier: please report it)")
                        verified += hit.blocks
                    try:
                        store.put(keys[hit.blocks:], fake_kv(keys[hit.blocks:], layout.block_bytes))
                    except CapacityError:
                        raise ConfigError(
                            f"--capacity {format_bytes(args.capacity)} ({tier0.capacity_blocks} block"
                            f"{'s' * (tier0.capacity_blocks != 1)}) is too small "
                            f"for this demo: turn {turn + 1} of session {s} saves {len(keys) - hit.blocks} new "
                            "blocks at once; give a larger --capacity, or fewer --sessions or --turns") from None
                    store.pin(f"session-{s}", keys, ttl=600)
                    history[s] += rng.integers(0, 150_000, int(rng.integers(50, 200))).tolist()  # the reply
                    turn_tokens += len(tokens)
                    turn_hits += hit.tokens
                    bar.advance()
                turns.append({"turn": turn + 1, "prompt_tokens": turn_tokens, "cached_tokens": turn_hits,
                              "hit_ratio": turn_hits / turn_tokens, "verified_blocks": verified, "verified": True})
        st = store.stats()
    finally:
        store.close()
    # Printed after the progress bar is gone: lines printed while it is live would go to
    # its terminal (stderr), not to stdout.
    for x in turns:
        say(f"turn {x['turn']}: {x['cached_tokens']:>7} of {x['prompt_tokens']:>7} prompt tokens from cache "
            f"({x['hit_ratio']:6.1%}), every load verified")
    t = st.tiers[0]
    total_tokens = sum(x["prompt_tokens"] for x in turns)
    hit_tokens = sum(x["cached_tokens"] for x in turns)
    say(f"total: {hit_tokens / total_tokens:.1%} of prompt tokens not recomputed; host tier holds "
        f"{t.used_blocks} blocks ({format_bytes(t.used_bytes)}), {t.evicted} evicted, "
        f"pinned {format_bytes(t.pinned_bytes)} for {st.pinned_sessions} sessions")
    if args.json:
        print(json.dumps({"sessions": args.sessions, "turns_per_session": args.turns, "layout": layout.describe(),
                          "capacity_bytes": args.capacity, "capacity_blocks": t.capacity_blocks,
                          "prompt_tokens": total_tokens, "cached_tokens": hit_tokens,
                          "hit_ratio": hit_tokens / total_tokens, "verified": True,
                          "verified_blocks": sum(x["verified_blocks"] for x in turns), "turns": turns,
                          "stats": st.as_dict()}))
    return 0
