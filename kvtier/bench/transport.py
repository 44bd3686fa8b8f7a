"""GET throughput between two node processes on loopback, against a raw socket send of the
same bytes between the same two processes, alternated in one run; with --tls, also node GET
over TLS (a throwaway self-signed certificate) against the same plain raw socket, which is
TLS's cost; with ucxx installed, also node GET over UCX against a raw ucxx send of the same
bytes (same block-sized messages)."""
from __future__ import annotations

import argparse

HELP = "time GET of blocks from another node process against a raw socket send of the same bytes"

SERVER = r'''
import socket, sys, threading, numpy as np, torch, kvtier
from kvtier.tiers.memory import allocate_host
bb, n = {bb}, {n}
layout = kvtier.KVLayout.mha(1, 1, bb // 32, 16, torch.uint8)
store = kvtier.Store(layout, [kvtier.HostTier(blocks=n)], kvtier.Namespace("bench"))
keys = store.keys(np.arange(16 * n))
store.put(keys, torch.from_numpy(np.random.default_rng(0).integers(0, 256, (n, bb), dtype=np.uint8)))
tls = kvtier.Tls(cert={cert!r}, key={key!r}) if {cert!r} else None
node = kvtier.Node(store, "127.0.0.1:0", {secret!r}, tls=tls).start()
raw = socket.create_server(("127.0.0.1", 0))
buf = allocate_host(n * bb).array[: n * bb]
buf[:] = 7

def serve_raw():
    while True:
        c, _ = raw.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            ask = c.recv(8)
            if len(ask) < 8:
                break
            size = int.from_bytes(ask, "big")
            for off in range(0, size, 1 << 20):   # 1 MiB sends: faster here than one large sendall
                c.sendall(memoryview(buf)[off: min(size, off + (1 << 20))])

threading.Thread(target=serve_raw, daemon=True).start()
ucx_node, ucx_raw = "-", "-"
if {ucx}:
    import asyncio, ucxx
    from kvtier.net import ucx as kucx
    unode = kvtier.Node(store, "127.0.0.1:0", {secret!r}, transport="ucx").start()   # kept: its listener lives with it
    ucx_node = unode.address

    async def serve_ucx_raw(ep):   # per request: the same bytes as block-sized tagged messages
        try:
            while True:
                await ep.am_recv()
                await asyncio.gather(*(ep.send(buf[i * bb:(i + 1) * bb]) for i in range(n)))
        except Exception:
            pass

    async def listen():
        return ucxx.create_listener(serve_ucx_raw)
    ucx_listener = kucx.run(listen(), None)
    ucx_raw = str(ucx_listener.port)
print(node.address, raw.getsockname()[1], ucx_node, ucx_raw, flush=True)
sys.stdin.read()
'''


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_int, size
    from kvtier.bench.common import size_list

    p.add_argument("--block-bytes", type=size_list, default=[1 << 20, 4 << 20], metavar="SIZES",
                   help="comma-separated block sizes, multiples of 32 bytes (default 1MiB,4MiB)")
    p.add_argument("--total", type=size, default=256 << 20, metavar="SIZE",
                   help="bytes per GET, at least one block (default 256MiB)")
    p.add_argument("--repeat", type=positive_int, default=9, metavar="N",
                   help="timed rounds, each the operation and its raw baseline: the median of the rounds' "
                        "ratios is reported, with a 90%% interval (default: 9)")
    p.add_argument("--transport", choices=("auto", "tcp", "ucx", "all"), default="auto",
                   help="auto (default: tcp, plus ucx where ucxx is installed), tcp, ucx, or all "
                        "(ucx: node GET over UCX vs raw ucxx; needs kvtier[ucx])")
    p.add_argument("--tls", action="store_true",
                   help="also time node GET over TLS (tcp+tls rows; a throwaway certificate, needs openssl)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    import socket

    import numpy as np

    from kvtier.bench.common import (Column, check_block_sizes, emit, fmt_float, fmt_size, interval_column, memory_hint,
                                     quiet_threads, timeit_pair)
    from kvtier.keys import Keyer, Namespace
    from kvtier.layout import KVLayout
    from kvtier.net import PeerClient
    from kvtier.progress import progress
    from kvtier.tiers.memory import allocate_host

    import torch

    sizes, total = args.block_bytes, args.total
    check_block_sizes(sizes, total, 32)
    if args.transport == "auto":
        import importlib.util
        args.transport = "all" if importlib.util.find_spec("ucxx") is not None else "tcp"
    has_ucx = args.transport in ("ucx", "all")
    if has_ucx:
        from kvtier.net.ucx import require_ucxx
        require_ucxx()      # a ConfigError that says how to install it
    quiet_threads()
    secret = b"bench-secret-0123456789abcdef"
    rows = []
    phases = [t for t in ("tcp", "ucx") if args.transport in (t, "all")]
    tls = None
    if getattr(args, "tls", False):
        import tempfile

        from kvtier.net.tls import Tls, throwaway_cert
        certs = tempfile.TemporaryDirectory(prefix="kvtier-bench-tls-")
        tls = throwaway_cert(certs.name)
        phases.insert(phases.index("tcp") + 1 if "tcp" in phases else 0, "tcp+tls")
    hint = f"each process holds about 2 times --total ({fmt_size(total)}) in memory: give a smaller --total"
    with memory_hint(hint), progress("transport", len(sizes) * len(phases), enabled=not args.json) as bar:
        for bb in sizes:
            n = total // bb
            layout = KVLayout.mha(1, 1, bb // 32, 16, torch.uint8)
            keyer = Keyer(Namespace("bench"), layout)
            keys = keyer(np.arange(16 * n))
            out = allocate_host(n * bb).array[: n * bb].reshape(n, bb)
            for phase in phases:
                bar.describe(f"{phase}, {fmt_size(bb)} blocks")
                # A server process of its own per transport: UCX's progress thread must not share
                # the CPU with the TCP timings.
                cert, key = (tls.cert, tls.key) if phase == "tcp+tls" and tls else ("", "")
                with _Server(SERVER.format(bb=bb, n=n, secret=secret, ucx=phase == "ucx", cert=cert,
                                           key=key)) as server:
                    node_addr, raw_port, ucx_addr, ucx_raw_port = server.addresses()
                    if phase == "ucx":
                        rows.append(_ucx_row(ucx_addr, int(ucx_raw_port), secret, keyer.seed, keys, out, bb, n,
                                             args.repeat))
                        bar.advance()
                        continue
                    client = PeerClient(node_addr, secret, keyer.seed, bb, timeout=30,
                                        tls=Tls(ca=tls.ca) if phase == "tcp+tls" and tls else None)
                    raw = socket.create_connection(("127.0.0.1", int(raw_port)))
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sink = memoryview(allocate_host(n * bb).array[: n * bb])

                    def get() -> None:
                        if client.get(keys, out) != n:
                            raise AssertionError("the node did not send every block")

                    def raw_get() -> None:
                        raw.sendall((n * bb).to_bytes(8, "big"))
                        got = 0
                        while got < n * bb:
                            got += raw.recv_into(sink[got:])

                    p = timeit_pair(get, raw_get, args.repeat)
                    rows.append({"bench": "transport", "transport": phase, "op": "get", "block_bytes": bb,
                                 "blocks": n, "gbps": n * bb / p.a / 1e9, "baseline_gbps": n * bb / p.b / 1e9,
                                 **p.fields(), "baseline": "raw socket send of the same bytes, 1 MiB sends"})
                    client.close()
                    raw.close()
                    bar.advance()
    gbps = fmt_float(2)
    emit(rows, args.json, "node GET vs raw send, loopback",
         [Column("transport", "transport"), Column("block_bytes", "block", fmt_size), Column("gbps", "GET GB/s", gbps),
          Column("baseline_gbps", "raw GB/s", gbps), Column("ratio", "ratio", fmt_float(2)), interval_column()], left=1)
    return 0


class _Server:
    """The serving node in a child process: started on entry, told to stop (stdin closed) on
    exit. Its stderr is kept, so a child that fails becomes one error line here."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __enter__(self) -> "_Server":
        import collections
        import subprocess
        import sys
        import threading

        self.proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: collections.deque[str] = collections.deque(maxlen=20)
        self.drain = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)
        self.drain.start()
        return self

    def addresses(self) -> list[str]:
        from kvtier.errors import KvtierError

        parts = self.proc.stdout.readline().split()
        if len(parts) != 4:
            self.proc.wait(timeout=30)
            self.drain.join(timeout=5)
            last = next((ln.strip() for ln in reversed(self.err) if ln.strip()), "no message")
            raise KvtierError(f"the benchmark's node process failed to start (exit {self.proc.returncode}): {last}")
        return parts

    def __exit__(self, *exc: object) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def _ucx_row(node_addr: str, raw_port: int, secret: bytes, seed: bytes, keys, out, bb: int, n: int,
             repeat: int) -> dict:
    """Node GET over UCX against raw ucxx: the same bytes as n block-sized tagged messages."""
    import asyncio

    import ucxx

    from kvtier.bench.common import timeit_pair
    from kvtier.net import PeerClient
    from kvtier.net import ucx as kucx
    from kvtier.tiers.memory import allocate_host

    client = PeerClient(node_addr, secret, seed, bb, timeout=30, transport="ucx")
    sink = allocate_host(n * bb).array[: n * bb].reshape(n, bb)
    ep = kucx.run(ucxx.create_endpoint("127.0.0.1", raw_port), None)

    async def raw_once() -> None:
        await ep.am_send(b"go")
        await asyncio.gather(*(ep.recv(sink[i]) for i in range(n)))

    def get() -> None:
        if client.get(keys, out) != n:
            raise AssertionError("the node did not send every block over UCX")

    def raw_get() -> None:
        kucx.run(raw_once(), None)

    p = timeit_pair(get, raw_get, repeat)
    client.close()
    kucx.run(ep.close(), None)
    return {"bench": "transport", "transport": "ucx", "op": "get", "block_bytes": bb, "blocks": n,
            "gbps": n * bb / p.a / 1e9, "baseline_gbps": n * bb / p.b / 1e9, **p.fields(),
            "baseline": "raw ucxx tagged sends of the same bytes, one per block", "ucx_tls": _tls()}


def _tls() -> str:
    import ucxx
    return ",".join(sorted(ucxx.get_active_transports()))
