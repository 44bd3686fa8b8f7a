"""Pull vs push of one prompt's blocks between two nodes on loopback (the P/D hand-over
without the engines), against a raw socket send of the same bytes, interleaved in one run.

- pull: the decode side's Remote asks the prefill node HAS + GET into rows (verified), then
  puts the rows into its own store (what a decode worker's admission does);
- push: the prefill side's Pusher asks the decode node HAS, then PUTs the blocks from slot
  memory (the receiver verifies and stores them);
- raw: connect, send an 8-byte request, receive the same bytes.
Connections are kept from one hand-over to the next, as between long-lived workers. Defaults: kimi-tiny's 40 KiB blocks, 21 of them (a ~340-token prompt).

    python bench/handoff.py [--blocks 21] [--rounds 200] [--json]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

import numpy as np
import torch

import kvtier
from kvtier.argtypes import positive_int
from kvtier.net import Node
from kvtier.net.push import Pusher

SECRET = b"bench-secret-0123456789abcdef"
LAYOUT = kvtier.KVLayout.mha(num_layers=4, num_kv_heads=2, head_dim=80, block_tokens=16, dtype=torch.float16)


def raw_server(nbytes: int) -> socket.socket:
    """A loopback server that answers each 8-byte request with nbytes from page-aligned memory."""
    from kvtier.tiers.memory import allocate_host
    srv = socket.create_server(("127.0.0.1", 0))
    buf = allocate_host(nbytes).array[:nbytes]
    buf[:] = 7

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while len(c.recv(8)) == 8:
                    c.sendall(memoryview(buf))
    threading.Thread(target=serve, daemon=True).start()
    return srv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=positive_int, default=21, help="blocks per hand-over (default 21)")
    p.add_argument("--rounds", type=positive_int, default=200, help="timed hand-overs of each kind (default 200)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    n, bb, ns = args.blocks, LAYOUT.block_bytes, kvtier.Namespace("bench-handoff")
    rng = np.random.default_rng(0)
    src = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=n * (args.rounds + 1))], ns)
    srv = raw_server(n * bb)
    sink = np.empty(n * bb, dtype=np.uint8)
    out = torch.empty(n, bb, dtype=torch.uint8)
    times: dict[str, list[float]] = {"pull": [], "push": [], "raw": []}
    with Node(src, "127.0.0.1:0", SECRET) as prefill:
        remote = kvtier.Remote([prefill.address], SECRET, timeout=5)
        pulled = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=n * (args.rounds + 1))], ns, remote=remote)                 # a decode worker's store, pulling
        pushed = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=n * (args.rounds + 1))], ns)
        pusher = Pusher(SECRET, timeout=5)
        raw = socket.create_connection(srv.getsockname())
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with Node(pushed, "127.0.0.1:0", SECRET) as decode:
            for i in range(args.rounds + 1):
                keys = src.keys(rng.integers(0, 2**31, n * LAYOUT.block_tokens).tolist())
                src.put(keys, torch.from_numpy(rng.integers(0, 256, (n, bb), dtype=np.uint8)))
                for what in (("pull", "push", "raw") if i % 2 == 0 else ("raw", "push", "pull")):
                    t0 = time.perf_counter()
                    if what == "pull":     # a get of blocks only the peer holds: fetched, verified, kept
                        got = pulled.get(keys, out).loaded
                    elif what == "push":   # HAS, then PUTs from slot memory; the receiver verifies and keeps
                        got = pusher.push(src, keys, decode.address).blocks
                    else:
                        raw.sendall(b"\0" * 8)
                        view, have = memoryview(sink), 0
                        while have < n * bb:
                            have += raw.recv_into(view[have:])
                        got = n
                    dt = time.perf_counter() - t0
                    held = {"pull": pulled, "push": pushed}.get(what)
                    if got != n or (held is not None and held.lookup(keys).blocks != n):
                        raise SystemExit(f"kvtier: error: the {what} hand-over moved {got} of {n} blocks")
                    if i:                  # round 0 warms up (connects)
                        times[what].append(dt)
        raw.close()
        pusher.close()
        pulled.close()
        pushed.close()
    srv.close()
    src.close()
    base = statistics.median(times["raw"])
    mb = n * bb / 1e6
    rows = []
    for what in ("pull", "push", "raw"):
        ts = sorted(times[what])
        med = statistics.median(ts)
        rows.append({"bench": "handoff", "mode": what, "blocks": n, "block_bytes": bb, "median_ms": round(med * 1e3, 3),
                     "p10_ms": round(ts[len(ts) // 10] * 1e3, 3), "p90_ms": round(ts[len(ts) * 9 // 10] * 1e3, 3),
                     "gb_per_s": round(mb / 1e3 / med, 3), "ratio_to_raw": round(base / med, 3)})
    for r in rows:
        print(json.dumps(r) if args.json else
              f"{r['mode']:5} {n} x {bb} B: median {r['median_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, p90 "
              f"{r['p90_ms']:.2f}), {r['gb_per_s']:.3f} GB/s, {r['ratio_to_raw']:.2f} of raw")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
