"""Nodes against hostile or broken clients, on loopback: a burst that exhausts file
descriptors, slow and oversized unauthenticated clients, replayed frames, plaintext
against TLS; and the public peer API (put, then get from another client), a salted node.
Every process a test starts is stopped by it; no test asserts a time."""
from __future__ import annotations

import hashlib
import hmac
import os
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import kvtier
from kvtier.net import NodeLimits, PeerClient, PeerError, Tls
from kvtier.errors import ConfigError
from kvtier.net import frames
from kvtier.net.frames import MAX_HEADER, PREFIX_BYTES, Frame, decode, read_prefix
from kvtier.net.tls import throwaway_cert as _throwaway_cert
from tests.conftest import REPO, assert_one_line_error, payload, run_kvtier

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)  # 8 KiB
NS = kvtier.Namespace("abuse-test")
SECRET = b"cluster-secret-0123456789abcdef"
RSS_DURING_MIB = 64        # the node's peak RSS over its baseline while abusive clients are connected
RSS_AFTER_MIB = 24         # and its RSS over the baseline once they have gone

NODE = r'''
import logging, sys, time, torch, kvtier
sys.path.insert(0, {repo!r})
from tests.conftest import payload
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
store = kvtier.Store(layout, [kvtier.HostTier(blocks=64)], kvtier.Namespace("abuse-test"))
keys = store.keys([1] * 32)
store.put(keys, payload(keys, layout.block_bytes))
node = kvtier.Node(store, "127.0.0.1:0", {secret!r}, request_timeout={timeout},
                   limits=kvtier.NodeLimits(**{limits!r})).start()
print(node.address, flush=True)
sys.stdin.read()              # until the test closes our stdin
node.stop()
store.close()
print("stopped", node.served, node.refused, flush=True)
'''


class NodeProcess:
    """A node in a child process (optionally under an open-files limit); stop() closes its
    stdin, waits for a clean exit and returns (stdout, stderr)."""

    def __init__(self, timeout: float = 10.0, limits: dict | None = None, nofile: int | None = None) -> None:
        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        code = NODE.format(repo=str(REPO), secret=SECRET, timeout=timeout, limits=limits or {})
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, preexec_fn=cap if nofile else None)
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.proc.kill()
            raise AssertionError(f"the node did not start: {self.proc.communicate(timeout=30)[1][-2000:]}")
        self.host, port = self.address.rsplit(":", 1)
        self.port = int(port)

    def rss_mib(self, field: str = "VmRSS") -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise AssertionError(field)

    def client(self) -> PeerClient:
        return PeerClient(self.address, SECRET, seed(), LAYOUT.block_bytes, timeout=10)

    def stop(self) -> tuple[str, str]:
        try:
            out, err = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the node did not stop: {err[-2000:]}")
        assert self.proc.returncode == 0, err[-2000:]
        return out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def node_process():
    started: list[NodeProcess] = []

    def start(**kw) -> NodeProcess:
        n = NodeProcess(**kw)
        started.append(n)
        return n
    yield start
    for n in started:
        n.kill()


def throwaway_cert(directory: str) -> Tls:
    """A self-signed certificate for 127.0.0.1 (skips the test where openssl is missing)."""
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests make a throwaway certificate with the openssl command")
    return _throwaway_cert(directory)


def seed(ns: kvtier.Namespace = NS) -> bytes:
    return ns.seed(LAYOUT)


def keys_of(tokens: list[int], ns: kvtier.Namespace = NS) -> list[bytes]:
    return kvtier.Keyer(ns, LAYOUT)(np.asarray(tokens))


def crafted_prefix(length: int, valid: bool) -> bytes:
    """A frame prefix claiming a `length`-byte header: with a valid tag (a peer holding the
    secret) or garbage (a stranger)."""
    head = struct.pack("!IQ8s", length, time.time_ns(), os.urandom(8))
    tag = hmac.new(frames._prefix_key(SECRET), head, hashlib.sha256).digest()[:16] if valid else os.urandom(16)
    return head + tag


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the node has closed this connection (EOF or reset; any ERR reply is drained)."""
    try:
        while True:
            if not select.select([s], [], [], 0)[0]:
                return False
            if not s.recv(65536):
                return True
    except OSError:
        return True


def wait_all_closed(socks: list[socket.socket], drip: bool = False, rounds: int = 200) -> None:
    """Until the node has closed every socket (bounded: `rounds` of 0.1 s); with `drip`, each
    open one is sent one more byte every round, the way a slow-drip client keeps a
    per-read deadline from ever passing."""
    open_ = list(socks)
    for _ in range(rounds):
        open_ = [s for s in open_ if not closed_by_peer(s)]
        if not open_:
            return
        if drip:
            for s in open_:
                try:
                    s.send(b"\0")
                except OSError:
                    pass
        time.sleep(0.1)
    raise AssertionError(f"{len(open_)} of {len(socks)} abusive connections are still open")


# -- descriptors ----------------------------------------------------------------------------
def test_a_burst_that_exhausts_file_descriptors_does_not_stop_the_node(node_process):
    """A node under a 1024 open-files limit (soft and hard, so it cannot raise it), with caps
    above it, gets 1,100 connections at once: accept fails with EMFILE; once they go, it
    accepts and serves again, and it stops cleanly."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        if hard != resource.RLIM_INFINITY and hard < 1400:
            pytest.skip("this test opens 1,100 sockets: the open-files hard limit is below 1,400")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
    node = node_process(timeout=30, nofile=1024,
                        limits={"max_connections": 100000, "max_unauthenticated": 100000})
    burst: list[socket.socket] = []
    try:
        for _ in range(1100):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((node.host, node.port))
            burst.append(s)
        c = node.client()
        with pytest.raises(PeerError):     # while the node is out of descriptors: a miss, not a hang
            PeerClient(node.address, SECRET, seed(), LAYOUT.block_bytes, timeout=0.5).has(keys_of([1] * 32))
    finally:
        for s in burst:
            s.close()
    keys = keys_of([1] * 32)
    for _ in range(100):                   # the burst drains: the node accepts again
        try:
            if c.has(keys) == 4:
                break
        except PeerError:
            time.sleep(0.2)
    assert c.has(keys) == 4
    c.close()
    out, err = node.stop()
    assert "accept failed" in err and "Too many open files" in err, err[-2000:]
    assert err.count("accept failed") < 20, "logged once per burst, not once per failure"
    assert "Traceback" not in err and "no current event loop" not in err, err[-2000:]
    assert out.startswith("stopped")


def test_connections_over_the_cap_are_closed_at_once():
    """At max_connections a new connection takes the place of the longest-waiting one that
    has not authenticated (silent strangers cannot hold every slot); only when every open
    connection is an authenticated peer is the new one closed at once."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with kvtier.Node(store, "127.0.0.1:0", SECRET, limits=NodeLimits(max_connections=4)) as node:
        host, port = node.address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        deadline = time.monotonic() + 10               # all four accepted and counted
        while node.gate.open < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert node.gate.open == 4
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as c:
            c.ping()                                      # served: the oldest silent one made room
        held[0].settimeout(10)
        assert held[0].recv(1) == b""
        for s in held:
            s.close()
        peers = [PeerClient.for_store(store, node.address, SECRET, timeout=5) for _ in range(4)]
        for _ in range(50):                               # once the node has seen the strangers go
            try:
                for c in peers:
                    c.ping()
                break
            except PeerError:
                time.sleep(0.1)
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(10)
        assert extra.recv(1) == b""                       # four authenticated peers: closed at once
        extra.close()
        assert node.gate.closed_over_cap >= 1 and node.gate.evicted >= 1
        for c in peers:
            c.close()
    store.close()


def test_idle_authenticated_connections_are_closed_and_the_client_reconnects():
    """A peer's kept connection that sends nothing for idle_timeout is closed, freeing its slot
    under max_connections; the client that kept it reconnects on its next call unnoticed."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    keys = store.keys(list(range(16)))
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    limits = NodeLimits(max_connections=2, idle_timeout=0.3)
    with kvtier.Node(store, "127.0.0.1:0", SECRET, request_timeout=0.5, limits=limits) as node:
        a = PeerClient.for_store(store, node.address, SECRET, timeout=5)
        b = PeerClient.for_store(store, node.address, SECRET, timeout=5)
        assert a.has(keys) == b.has(keys) == 2                  # two authenticated connections: the cap
        for _ in range(100):                                    # both go idle and are closed
            if node.gate.closed_idle == 2:
                break
            time.sleep(0.05)
        assert node.gate.closed_idle == 2 and node.gate.open == 0
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as c:
            assert c.has(keys) == 2                             # a newcomer gets a slot
        rows = np.zeros((2, LAYOUT.block_bytes), np.uint8)
        assert a.get(keys, rows) == 2                           # the old clients reconnect once, unnoticed
        assert rows.tobytes() == payload(keys, LAYOUT.block_bytes).numpy().tobytes()
        assert b.has(keys) == 2
        a.close()
        b.close()
    store.close()
    with pytest.raises(kvtier.ConfigError, match="idle_timeout"):
        NodeLimits(idle_timeout=0)


def test_a_node_stops_cleanly_in_every_state():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    kvtier.Node(store, "127.0.0.1:0", SECRET).stop()                  # never started
    node = kvtier.Node(store, "127.0.0.1:0", SECRET).start()
    host, port = node.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    node.stop()                                                      # with a connection open
    node.stop()                                                      # twice
    s.close()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        failed = kvtier.Node(store, "127.0.0.1:%d" % busy.getsockname()[1], SECRET)
        with pytest.raises(kvtier.ConfigError, match="in use"):
            failed.start()
        failed.stop()                                                # after a failed start
    store.close()


def test_silent_strangers_cannot_lock_peers_out(node_process):
    """max_unauthenticated connections that say nothing (no secret needed) used to refuse
    every new peer until the first frame's deadline passed; now a new connection closes the
    one that has waited longest, so a peer is served at once (the second time no stranger
    need go: the first peer's slot is free again), and the node logs it."""
    node = node_process(timeout=30, limits={"max_unauthenticated": 8})
    silent = [socket.create_connection((node.host, node.port)) for _ in range(8)]
    keys = keys_of([1] * 32)
    try:
        time.sleep(0.3)                        # all eight accepted and waiting
        for _ in range(2):
            c = PeerClient(node.address, SECRET, seed(), LAYOUT.block_bytes, timeout=5)
            assert c.has(keys) == 4            # a fresh connection each time, served
            c.close()
        time.sleep(0.3)
        gone = [s for s in silent if closed_by_peer(s)]
        assert gone == silent[:1], "the longest-waiting stranger was closed, the others wait on"
    finally:
        for s in silent:
            s.close()
    _, err = node.stop()
    assert "closed to admit newer ones" in err and "Traceback" not in err, err[-2000:]


# -- memory ---------------------------------------------------------------------------------
def test_slow_and_oversized_unauthenticated_clients_cannot_make_a_node_hold_memory(node_process):
    """192 abusive connections at once, 48 of each: a stranger's prefix claiming a 4 MiB
    header followed by 4 MiB of junk (refused on its 36 bytes), a slow drip (a byte every
    0.1 s: dropped when the frame's deadline passes), a silent one (dropped at the first
    frame's deadline), and a peer with the secret claiming a 4 MiB header it never sends
    (bounded by the node's pre-authentication budget). The node's peak RSS stays within
    RSS_DURING_MIB of its baseline, it is back within RSS_AFTER_MIB once they are gone, and
    it serves throughout."""
    node = node_process(timeout=3, limits={"max_unauthenticated": 512})
    c = node.client()
    keys = keys_of([1] * 32)
    out = np.zeros((4, LAYOUT.block_bytes), dtype=np.uint8)
    assert c.get(keys, out) == 4
    base = node.rss_mib()
    junk = os.urandom(1 << 20)
    socks: dict[str, list[socket.socket]] = {k: [] for k in ("oversized", "drip", "silent", "claim")}
    try:
        for kind, group in socks.items():
            for _ in range(48):
                s = socket.create_connection((node.host, node.port))
                s.setblocking(False)
                group.append(s)
                try:
                    if kind == "oversized":
                        s.send(crafted_prefix(MAX_HEADER, valid=False))
                        for _ in range(4):
                            s.send(junk)
                    elif kind == "drip":
                        s.send(b"\0")
                    elif kind == "claim":
                        s.send(crafted_prefix(MAX_HEADER, valid=True) + junk[:1000])
                except OSError:       # the node closed it already (or its buffer is full)
                    pass
        assert c.has(keys) == 4                          # it serves others meanwhile
        wait_all_closed(socks["drip"], drip=True)        # a slow drip is dropped at the frame's deadline
        wait_all_closed(socks["oversized"] + socks["silent"] + socks["claim"])
        peak, after = node.rss_mib("VmHWM"), node.rss_mib()
    finally:
        for group in socks.values():
            for s in group:
                s.close()
    print(f"node RSS: baseline {base:.0f} MiB, peak during abuse {peak:.0f} MiB, after {after:.0f} MiB")
    assert peak - base <= RSS_DURING_MIB, (base, peak)
    assert after - base <= RSS_AFTER_MIB, (base, after)
    assert c.get(keys, out) == 4 and np.array_equal(out, payload(keys, LAYOUT.block_bytes).numpy())
    c.close()
    _, err = node.stop()
    assert "refused a frame" in err and "Traceback" not in err


# -- the log --------------------------------------------------------------------------------
def hammer(node: kvtier.Node, n: int, data: bytes) -> None:
    """n strangers, one after another: connect, send `data`, close; until the node has dealt
    with all: refused each, or (a loaded machine: accepted faster than read) closed the
    longest-waiting to admit a newer one (gate.evicted; some of those it had refused first)."""
    host, port = node.address.rsplit(":", 1)
    for _ in range(n):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(data)
    deadline = time.monotonic() + 30
    while node.refused + node.gate.evicted < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert node.refused + node.gate.evicted >= n


def test_strangers_in_a_loop_cannot_flood_the_log(caplog):
    """A loop that connects, sends 36 zero bytes and closes made a warning per connection
    (10,158 lines in 3 s); refusals are counted and logged at the 1st, 10th, 100th, ..."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with caplog.at_level("WARNING", logger="kvtier.node"), kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        hammer(node, 150, b"\0" * PREFIX_BYTES)
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as c:
            c.ping()                                      # and it serves its peers meanwhile
    lines = [r.getMessage() for r in caplog.records if "refused a frame" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "bad frame prefix" in lines[0] and "(100 frames refused from peers without the secret so far" in lines[2]
    store.close()


def test_a_misconfigured_peer_is_logged_whatever_strangers_sent_before(caplog):
    """Refusals shared one 1st/10th/100th counter: after a stranger's 150 frames, a peer with
    the secret but another namespace (its 1st refusal, the node's 151st) was never logged."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    other = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], kvtier.Namespace("another-model"))
    with caplog.at_level("WARNING", logger="kvtier.node"), kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        hammer(node, 150, b"\0" * PREFIX_BYTES)
        with PeerClient.for_store(other, node.address, SECRET, timeout=5) as c, pytest.raises(PeerError):
            c.has(other.keys(list(range(LAYOUT.block_tokens))))
    lines = [r.getMessage() for r in caplog.records if "refused a frame" in r.getMessage()]
    assert any("another namespace" in m for m in lines), lines
    store.close()
    other.close()


def test_an_http_client_at_a_node_port_is_told_so(caplog):
    """curl at a node's port read "bad frame prefix ... secret" in the node's log and got 36
    zero bytes: it now gets a 400 that says what the port is, and the log names HTTP."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with caplog.at_level("WARNING", logger="kvtier.node"), kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        host, port = node.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"\0" * PREFIX_BYTES)                # a stranger still gets the constant refusal
            assert s.recv(4096) == frames.REFUSAL
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert b"kvtier node port" in body and f"Content-Length: {len(body)}".encode() in head
    lines = [r.getMessage() for r in caplog.records if "refused a frame" in r.getMessage()]
    assert "an HTTP request" in lines[0] and "secret" not in lines[0], lines
    store.close()


def test_a_redis_directory_pointed_at_a_node_port_is_told_so(caplog):
    """`--directory redis://NODE` read "Redis unreachable (timeout)": the node answers a Redis
    command with a RESP error, and the directory calls it a setting to fix at once."""
    pytest.importorskip("redis")
    from kvtier.net.directory import RedisDirectory
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with caplog.at_level("WARNING", logger="kvtier.node"), kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        with pytest.raises(ConfigError, match="kvtier node's port, not Redis") as e:
            RedisDirectory(f"redis://{node.address}", timeout=5)
    assert "--peers" in str(e.value)
    lines = [r.getMessage() for r in caplog.records if "refused a frame" in r.getMessage()]
    assert "a Redis command" in lines[0], lines
    store.close()


def test_a_refused_put_says_why_not_broken_pipe():
    """A node refuses a PUT of another namespace or secret without reading its payload and
    closes: the client's send broke ("broken pipe", "connection reset", refused=False: a
    prefill worker took the misconfigured node for a dead one) in 13 of 18 tries."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=64)], NS)
    other = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=64)], kvtier.Namespace("another-model"))
    keys = other.keys(list(range(40 * LAYOUT.block_tokens)))
    with kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        for secret, why in ((SECRET, "another namespace"), (b"y" * 32, "secret")):
            for _ in range(3):
                with PeerClient.for_store(other, node.address, secret, timeout=5) as c, \
                        pytest.raises(PeerError, match=why) as e:
                    c.put(keys, np.zeros((40, LAYOUT.block_bytes), np.uint8))
                assert e.value.refused, e.value
    store.close()
    other.close()


def test_a_client_dialling_an_http_server_is_told_so():
    """A node address that names an HTTP server (serve's port given as a peer) is reported as
    one, not as a secret mismatch."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\n\r\nInvalid HTTP")

    import threading
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with PeerClient.for_store(store, f"127.0.0.1:{port}", SECRET, timeout=5) as c, \
            pytest.raises(PeerError, match="HTTP server") as e:
        c.ping()
    assert "secret" not in str(e.value)
    t.join(5)
    server.close()
    store.close()


@pytest.mark.parametrize("first, named", [(b"\x16\x03\x01\x02\x00", "TLS handshake"), (b"SSH-2.0-OpenSSH_9", "SSH")])
def test_other_protocols_are_named(first: bytes, named: str):
    with pytest.raises(frames.ForeignProtocol, match=named):
        read_prefix(first.ljust(PREFIX_BYTES, b"x"), SECRET)
    with pytest.raises(frames.FrameError, match="secret"):
        read_prefix(b"x" * PREFIX_BYTES, SECRET)


def test_failed_tls_handshakes_cannot_flood_the_log(tmp_path, caplog):
    tls = throwaway_cert(str(tmp_path))
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with caplog.at_level("WARNING", logger="kvtier.node"), \
            kvtier.Node(store, "127.0.0.1:0", SECRET, tls=Tls(cert=tls.cert, key=tls.key)) as node:
        hammer(node, 12, b"\0" * PREFIX_BYTES)         # plaintext junk: no handshake
    lines = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(lines) == 2 and "(10 failed TLS handshakes so far" in lines[1], lines
    store.close()


# -- replay ---------------------------------------------------------------------------------
def _exchange(address: str, data: bytes) -> Frame:
    """Send raw frame bytes on a new connection; the node's reply."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        f = s.makefile("rb")
        prefix = f.read(PREFIX_BYTES)
        n = read_prefix(prefix, SECRET).length
        body = f.read(n + 32)
        return decode(prefix, body[:n], body[n:], SECRET)


def test_a_replayed_frame_is_refused():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    keys = store.keys([2] * 32)
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    with kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        captured = Frame("HAS", store.keyer.seed, keys).encode(SECRET)
        first = _exchange(node.address, captured)
        assert (first.op, first.n) == ("OK", 4)
        again = _exchange(node.address, captured)         # the same bytes on a new connection
        assert again.op == "ERR" and "replayed" in again.error
        assert node.refused == 1 and len(node.replays) >= 1
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as c:
            assert c.has(keys) == 4                        # fresh frames are served
    store.close()


def test_strangers_get_a_constant_refusal_and_replies_sent_back_never_enter_the_replay_table():
    """A stranger's garbage was answered with an ERR MAC'd with the cluster secret; sent back on
    a new connection it passed every check (a fresh nonce in the replay table) and was refused
    only for its namespace: strangers could fill the table, whose horizon then refuses peers."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with kvtier.Node(store, "127.0.0.1:0", SECRET) as node:
        host, port = node.address.rsplit(":", 1)
        for junk in (os.urandom(PREFIX_BYTES), frames.REFUSAL):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(junk)
                s.settimeout(10)
                assert s.makefile("rb").read() == frames.REFUSAL      # "not this cluster", and closed
        before = len(node.replays)
        for op in ("ERR", "OK"):                          # a reply of the node's (or any holder's), sent back
            f = Frame(op, store.keyer.seed, [], error="x" if op == "ERR" else "")
            got = _exchange(node.address, f.encode(SECRET))
            assert got.op == "ERR" and "is a reply, not a request" in got.error
        assert len(node.replays) == before
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as c:
            c.ping()                                      # its peers are served
        assert len(node.replays) == before + 1
    store.close()


def test_the_replay_table_is_bounded_and_never_forgets_too_early():
    from kvtier.net.replay import ReplayGuard

    g = ReplayGuard(window=30, capacity=100)
    now = 1000.0
    for i in range(250):
        g.check(i.to_bytes(16, "big"), now + i * 0.001, now)
    assert len(g) == 100
    with pytest.raises(kvtier.net.FrameError, match="stale"):      # forgotten, so refused as stale
        g.check((3).to_bytes(16, "big"), now + 0.003, now)
    with pytest.raises(kvtier.net.FrameError, match="replayed"):
        g.check((249).to_bytes(16, "big"), now + 0.249, now)
    g.check(b"x" * 16, now + 40, now + 40)                           # time passes: old entries go
    assert len(g) == 1


# -- the peer API ---------------------------------------------------------------------------
def test_put_to_a_node_then_get_from_another_client_round_trips_byte_exact():
    served = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS)
    with kvtier.Node(served, "127.0.0.1:0", SECRET) as node:
        keys = keys_of(list(range(64)))
        blocks = payload(keys, LAYOUT.block_bytes)                  # a CPU torch tensor
        with kvtier.PeerClient(node.address, SECRET, seed(), LAYOUT.block_bytes, timeout=5) as a:
            assert a.put(keys, blocks) == 8
            assert a.put(keys, blocks) == 0                          # already there
        with kvtier.PeerClient(node.address, SECRET, seed(), LAYOUT.block_bytes, timeout=5) as b:
            out = np.zeros((8, LAYOUT.block_bytes), dtype=np.uint8)
            assert b.has(keys) == 8 and b.get(keys, out) == 8
            assert np.array_equal(out, blocks.numpy())
            with pytest.raises(kvtier.ConfigError, match="uint8"):
                b.put(keys, np.zeros((8, 5), dtype=np.uint8))
    served.close()


# -- TLS ------------------------------------------------------------------------------------
def test_tls_round_trip_and_a_plaintext_client_is_refused_cleanly(tmp_path):
    tls = throwaway_cert(str(tmp_path))
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS)
    keys = store.keys([4] * 32)
    want = payload(keys, LAYOUT.block_bytes)
    with kvtier.Node(store, "127.0.0.1:0", SECRET, tls=Tls(cert=tls.cert, key=tls.key)) as node:
        with PeerClient.for_store(store, node.address, SECRET, timeout=5, tls=Tls(ca=tls.ca)) as c:
            assert c.put(keys, want) == 4
            out = np.zeros((4, LAYOUT.block_bytes), dtype=np.uint8)
            assert c.get(keys, out) == 4 and np.array_equal(out, want.numpy())
        with PeerClient.for_store(store, node.address, SECRET, timeout=5) as plain:
            with pytest.raises(PeerError, match="closed the connection without answering"):
                plain.has(keys)
        (tmp_path / "other").mkdir()
        other_ca = throwaway_cert(str(tmp_path / "other"))             # a CA that did not sign the node's
        with PeerClient.for_store(store, node.address, SECRET, timeout=5, tls=Tls(ca=other_ca.ca)) as wrong:
            with pytest.raises(PeerError, match="certificate does not verify"):
                wrong.has(keys)
        remote = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS,
                              remote=kvtier.Remote([node.address], SECRET, timeout=5, tls=Tls(ca=tls.ca)))
        out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
        assert remote.get(keys, out).loaded == 4 and torch.equal(out, want)     # a store over TLS
        remote.close()
        assert node.refused >= 1
    with kvtier.Node(store, "127.0.0.1:0", SECRET) as plain_node:            # TLS client, plain node
        with PeerClient.for_store(store, plain_node.address, SECRET, timeout=5, tls=Tls(ca=tls.ca)) as c:
            with pytest.raises(PeerError, match="is the node serving TLS"):
                c.has(keys)
    with pytest.raises(kvtier.ConfigError, match="does not exist"):
        kvtier.Node(store, "127.0.0.1:0", SECRET, tls=Tls(cert=str(tmp_path / "nope.pem"), key=tls.key))
    with pytest.raises(kvtier.ConfigError, match="CA file"):
        kvtier.Remote(["127.0.0.1:1"], SECRET, tls=Tls())
    store.close()


# -- the command ----------------------------------------------------------------------------
def test_a_salted_tls_cli_node_serves_its_tenant_only(tmp_path):
    tls = throwaway_cert(str(tmp_path))
    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "salt").write_bytes(b"tenant-a\n")
    layout = kvtier.preset_layout("llama3-8b", 16)
    cmd = [sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b",
           "--block-tokens", "16", "--capacity", "64MiB", "--model", "m", "--secret-file", str(tmp_path / "secret"),
           "--salt-file", str(tmp_path / "salt"), "--tls-cert", tls.cert, "--tls-key", tls.key]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "serving 'm'" in line and "tenant salt" in line and "TLS" in line, line
        addr = line.rsplit(" on ", 1)[1].strip()
        mine, default = kvtier.Namespace("m", salt=b"tenant-a"), kvtier.Namespace("m")
        ca = Tls(ca=tls.ca)
        keys = kvtier.Keyer(mine, layout)(np.arange(64))
        rows = payload(keys, layout.block_bytes)
        with PeerClient(addr, SECRET, mine.seed(layout), layout.block_bytes, timeout=5, tls=ca) as c:
            assert c.put(keys, rows) == 4 and c.has(keys) == 4
        with PeerClient(addr, SECRET, default.seed(layout), layout.block_bytes, timeout=5, tls=ca) as other:
            with pytest.raises(PeerError, match="another namespace") as e:
                other.has(kvtier.Keyer(default, layout)(np.arange(64)))
            assert e.value.refused
        with PeerClient(addr, SECRET, mine.seed(layout), layout.block_bytes, timeout=5, tls=ca) as c:
            out = np.zeros((4, layout.block_bytes), dtype=np.uint8)
            assert c.get(keys, out) == 4 and np.array_equal(out, rows.numpy())
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "refused 1" in out


@pytest.mark.parametrize("args,needle", [
    (("--salt-file", "/nonexistent/salt"), "salt file"),
    (("--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"), "TLS certificate"),
    (("--tls-cert", "/nonexistent/cert.pem"), "--tls-key"),
    (("--tls-ca", "/nonexistent/ca.pem", "--peers", "127.0.0.1:9"), "CA file"),
])
def test_bad_salt_or_tls_files_are_one_line_errors(args, needle):
    env = {**os.environ, "KVTIER_SECRET": SECRET.decode()}
    r = run_kvtier("node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b", "--capacity", "64MiB", *args,
                   env=env, timeout=60)
    assert_one_line_error(r, 2, needle)


def _reply(s: socket.socket) -> Frame:
    """Read one whole reply frame (prefix, header, MAC) off `s` and decode it."""
    data = b""
    while len(data) < PREFIX_BYTES:
        chunk = s.recv(65536)
        assert chunk, "the node closed before replying"
        data += chunk
    p = read_prefix(data[:PREFIX_BYTES], SECRET)
    need = PREFIX_BYTES + p.length + 32
    while len(data) < need:
        chunk = s.recv(65536)
        assert chunk, "the node closed mid-reply"
        data += chunk
    return decode(data[:PREFIX_BYTES], data[PREFIX_BYTES:PREFIX_BYTES + p.length],
                  data[PREFIX_BYTES + p.length:need], SECRET)


def test_a_refusal_never_tells_another_tenant_this_nodes_namespace_seed(node_process):
    """A peer with the cluster secret but another tenant's salt is refused, and the ERR reply
    carries the asker's own namespace: with the node's seed it could build this tenant's keys
    for any prompt it guesses and read them."""
    node = node_process()
    other = kvtier.Namespace("abuse-test", salt=b"tenant-b")
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        s.sendall(Frame("HAS", seed(other), keys_of([1] * 32, other)).encode(SECRET))
        reply = _reply(s)
    assert reply.op == "ERR" and "another namespace" in reply.error
    assert reply.ns == seed(other) and reply.ns != seed()
    with socket.create_connection((node.host, node.port), timeout=10) as s:   # a stranger: nothing either
        s.sendall(crafted_prefix(100, valid=False) + b"\0" * 200)
        try:
            assert seed() not in s.recv(65536)
        except ConnectionResetError:
            pass


def test_a_put_larger_than_the_top_tier_is_refused_before_its_buffer_is_allocated(node_process):
    """A header announcing 60,000 blocks (490 MB) into a 64-block tier is refused at once, with
    an ERR reply, and the node's memory does not grow by the announced payload."""
    node = node_process()
    peak = node.rss_mib("VmHWM")
    n = 60_000
    keys = [os.urandom(16) for _ in range(n)]
    head = Frame("PUT", seed(), keys, payload=n * LAYOUT.block_bytes, sums=[0] * n).encode(SECRET)
    with socket.create_connection((node.host, node.port), timeout=10) as s:
        s.sendall(head)
        reply = _reply(s)
    assert reply.op == "ERR" and "cannot fit in this node's top tier of 64 blocks" in reply.error
    assert node.rss_mib("VmHWM") - peak < RSS_DURING_MIB     # its peak did not move by the payload
    assert node.client().has(keys_of([1] * 32)) == 4        # and it goes on serving
    _, err = node.stop()
    assert "Traceback" not in err and "MemoryError" not in err
