"""The UCX transport (ucxx): blocks cross node processes byte-exact; faults cost misses, never hangs."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import kvtier
from tests.conftest import REPO, payload
from kvtier.net import PeerClient, PeerError
from tests.test_node import LAYOUT, NODE, NS, SECRET, assert_each_fetched, fetch

pytest.importorskip("ucxx", reason="ucxx is not installed: pip install 'kvtier[ucx]' to test the UCX transport")

ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}


@pytest.fixture
def spawn(children):
    """A UCX node process holding the prompts of `seeds`; returns (process, address)."""
    def start(seeds):
        return children(NODE.format(repo=str(REPO), blocks=64, seeds=list(seeds), tokens=32, secret=SECRET,
                                    transport="ucx"), env=ENV)
    return start


def client_store(peers, secret=SECRET, timeout=2.0):
    remote = kvtier.Remote(peers, secret, timeout=timeout, transport="ucx")
    return kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=64)], NS, remote=remote)


def test_two_nodes_exchange_blocks_byte_exact_over_ucx(spawn):
    _, addr = spawn(seeds=[1, 2])
    store = client_store([addr])
    keys = store.keys([1] * 32)
    assert store.lookup(keys).by_tier() == {"host": 0, "remote": 4}
    loaded, out = fetch(store, keys)
    assert loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    assert store.lookup(keys).by_tier() == {"host": 4, "remote": 0}      # promoted: next time local
    assert store.lookup(store.keys([2] * 16 + [7] * 16)).blocks == 2    # the peer has half of it
    store.close()


def test_three_nodes_over_ucx_fetch_from_the_holder(spawn):
    _, a = spawn(seeds=[10])
    _, b = spawn(seeds=[20, 21])
    store = client_store([a, b])
    assert_each_fetched(store, (10, 20, 21))
    store.close()


def test_put_over_ucx_then_get_back(spawn):
    _, addr = spawn(seeds=[])
    keys = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS).keys([5] * 32)
    c = kvtier.net.PeerClient(addr, SECRET, kvtier.keys.Keyer(NS, LAYOUT).seed, LAYOUT.block_bytes, 2.0,
                              transport="ucx")
    rows = payload(keys, LAYOUT.block_bytes).numpy()
    assert c.put(keys, rows) == 4
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8).numpy()
    assert c.get(keys, out) == 4 and (out == rows).all()
    c.close()


def test_wrong_secret_is_refused_over_ucx(spawn):
    _, addr = spawn(seeds=[1])
    store = client_store([addr], secret=b"another-secret-0123456789abcdef")
    keys = store.keys([1] * 32)
    assert store.lookup(keys).blocks == 0
    assert fetch(store, keys)[0] == 0
    assert store.stats().remote["errors"] >= 1
    store.close()


def test_killed_ucx_peer_costs_a_miss_not_a_hang(spawn):
    proc, addr = spawn(seeds=[1])
    store = client_store([addr], timeout=1.0)
    keys = store.keys([1] * 32)
    assert store.lookup(keys).blocks == 4                 # connected, then the peer dies
    proc.kill()
    proc.wait()
    t = time.monotonic()
    loaded, _ = fetch(store, keys)
    assert loaded == 0 and time.monotonic() - t < 5
    assert store.stats().remote["errors"] >= 1
    store.close()


def test_unknown_transport_is_a_config_error():
    with pytest.raises(kvtier.errors.ConfigError):
        kvtier.Remote(["127.0.0.1:1"], SECRET, transport="carrier-pigeon")


def test_stalled_ucx_peer_costs_a_miss_within_the_timeout(spawn):
    proc, addr = spawn(seeds=[1])
    store = client_store([addr], timeout=1.0)
    keys = store.keys([1] * 32)
    assert store.lookup(keys).blocks == 4
    proc.send_signal(signal.SIGSTOP)                      # alive but silent
    try:
        t = time.monotonic()
        loaded, _ = fetch(store, keys)
        assert loaded == 0 and time.monotonic() - t < 5
    finally:
        proc.send_signal(signal.SIGCONT)
    store.close()


# A fresh process (no UCX state from other tests) that opens, uses and closes UCX stores one
# after another, and prints its descriptors and threads before and after each.
STORES_OPENED_AND_CLOSED = r"""
import json, os, sys, threading, time, torch, kvtier
sys.path.insert(0, {repo!r})
from tests.test_node import LAYOUT, NS, SECRET

def counts():
    deadline = time.monotonic() + 5     # a store's pool threads take a moment to end
    while True:
        c = dict(fds=len(os.listdir("/proc/self/fd")), tasks=len(os.listdir("/proc/self/task")),
                 threads=sorted(t.name for t in threading.enumerate()))
        if len(c["threads"]) == 1 or time.monotonic() > deadline:
            return c
        time.sleep(0.05)

rows = [counts()]
for _ in range(3):
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS,
                         remote=kvtier.Remote([{addr!r}], SECRET, timeout=5.0, transport="ucx"))
    keys = store.keys([1] * 32)
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    assert store.lookup(keys).blocks == 4 and store.get(keys, out).loaded == 4
    store.close()
    rows.append(counts())
print(json.dumps(rows))
"""


def test_closing_the_last_ucx_store_gives_back_its_threads_and_descriptors(spawn):
    """ucxx's context and worker (19 descriptors, a `kvtier-ucx` thread and ucxx's own threads
    here) stayed for the process's life after its stores closed; now the last close frees
    them, every time: nothing is left, and nothing builds up store after store."""
    _, addr = spawn(seeds=[1])
    r = subprocess.run([sys.executable, "-c", STORES_OPENED_AND_CLOSED.format(repo=str(REPO), addr=addr)],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    before, *after = json.loads(r.stdout.splitlines()[-1])
    for row in after:
        assert row == before, (before, after)      # descriptors, OS threads, Python threads (no kvtier-ucx)


def test_a_killed_ucx_node_is_unreachable_at_once_not_a_timeout(spawn):
    """A node killed with SIGKILL: each call to it fails as over TCP, at once and naming the
    refused connection, rather than waiting out its deadline (ucxx's connect missed the
    refusal when it came as its handshake was posted, and every call then took the deadline)."""
    proc, addr = spawn(seeds=[1])
    seed = kvtier.keys.Keyer(NS, LAYOUT).seed
    keys = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS).keys([1] * 32)
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8).numpy()
    warm = PeerClient(addr, SECRET, seed, LAYOUT.block_bytes, 5.0, transport="ucx")
    assert warm.get(keys, out) == 4
    proc.kill()
    proc.wait()
    clients = [warm] + [PeerClient(addr, SECRET, seed, LAYOUT.block_bytes, 5.0, transport="ucx") for _ in range(4)]
    for c in clients:                      # a kept connection, then fresh ones
        t = time.monotonic()
        with pytest.raises(PeerError) as e:
            c.get(keys, out)
        assert "connection refused" in e.value.reason or "reset" in e.value.reason, e.value.reason
        assert not e.value.refused          # unreachable, not "refusing requests"
        assert time.monotonic() - t < 2.5   # generous: half the 5 s deadline it used to take
        c.close()


def test_a_request_that_timed_out_does_not_break_later_ucx_connections(spawn):
    """ucxx queues an active-message receive by its endpoint's UCP handle and keeps a
    cancelled one; once that endpoint was freed, UCX gave its handle to the next endpoint, whose
    first reply the stale receive took: after one request to a frozen node timed out, every
    later request of the process, to healthy nodes on fresh connections, timed out too."""
    frozen, a = spawn(seeds=[1])
    _, b = spawn(seeds=[1])
    seed = kvtier.keys.Keyer(NS, LAYOUT).seed
    keys = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS).keys([1] * 32)
    c = PeerClient(a, SECRET, seed, LAYOUT.block_bytes, 1.0, transport="ucx")
    assert c.has(keys) == 4
    frozen.send_signal(signal.SIGSTOP)
    try:
        wait_stopped(frozen.pid)
        with pytest.raises(PeerError):
            c.has(keys)                     # times out, its receive left waiting
        c.close()
        for _ in range(3):
            healthy = PeerClient(b, SECRET, seed, LAYOUT.block_bytes, 2.0, transport="ucx")
            assert healthy.has(keys) == 4
            healthy.close()
    finally:
        frozen.send_signal(signal.SIGCONT)


def wait_stopped(pid: int) -> None:
    """Until process `pid` is stopped (SIGSTOP takes effect when the kernel next schedules it)."""
    deadline = time.monotonic() + 10
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the node did not stop"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ucx_error_lines_for_a_dead_peer_stay_off_stdout():
    """UCX logs to stdout: each failed connect printed a `UCXX ERROR ... endpoint error
    callback` line there, into machine-readable output. They go to stderr now."""
    code = (f"import kvtier\nfrom kvtier.net import PeerClient, PeerError\n"
            f"c = PeerClient('127.0.0.1:{free_port()}', {SECRET!r}, bytes(16), 64, 2.0, transport='ucx')\n"
            "for _ in range(3):\n    try:\n        c.has([b'k' * 32])\n    except PeerError:\n        pass\n"
            "c.close()\nprint('done')\n")
    env = {k: v for k, v in ENV.items() if k != "UCX_LOG_FILE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "done\n", r.stdout


# A fresh process with ucxx's context and worker left out (no real endpoints): fake endpoints
# show the order of a channel's steps on the UCX loop, with windows widened by sleeps.
CHANNEL_RACES = r"""
import asyncio, json, sys, threading, time
sys.path.insert(0, {repo!r})
import kvtier.net.ucx as u

async def nothing():
    pass
u._create_context = u._reset = nothing

class Req:
    completed, status = False, 0
    async def wait(self):
        await asyncio.sleep(3600)       # a reply that never comes

class Ep:
    aborted = False
    def __init__(self, slow=0.0):
        self.slow = slow
    @property
    def alive(self):                    # slow: _am_recv is between reading the endpoint and posting
        time.sleep(self.slow)
        return True
    def am_probe(self):
        return False
    def am_recv(self):
        return Req()
    async def am_send(self, head):
        pass
    def abort(self, period=0):
        self.aborted = True

out = {{}}
# 1. close() while the timed-out request is posting its receive (on the loop).
ch = u.UcxChannel(("127.0.0.1", 1))
ep = ch.ep = Ep(slow=0.3)
try:
    ch.request(b"h", None, time.monotonic() + 0.1, lambda p: 0)
except TimeoutError:
    pass
ch.close()
out["posted"] = dict(freed=ep.aborted, kept=any(k.ep is ep for k in u._QUARANTINED))

# 2. close() from another thread while the channel connects: the endpoint made after it.
made = []
async def connect(addr, seconds):
    await asyncio.sleep(0.3)
    made.append(Ep())
    return made[-1]
u._connect = connect
ch = u.UcxChannel(("127.0.0.1", 2))
err = []
def call():
    try:
        ch.request(b"h", None, time.monotonic() + 5, lambda p: 0)
    except OSError as e:
        err.append(str(e))
t = threading.Thread(target=call)
t.start()
time.sleep(0.1)
ch.close()
t.join()
out["connected"] = dict(freed=made[0].aborted, error=err, kept_ep=ch.ep is not None)

# 3. a channel used after close() takes no hold on the runtime.
holders = u._Runtime._holders
try:
    ch.request(b"h", None, time.monotonic() + 1, lambda p: 0)
except OSError as e:
    out["after_close"] = str(e)
out["holders_added"] = u._Runtime._holders - holders

# 4. close() from another thread while request() takes its hold on the runtime.
RealLease = u.Lease
class SlowLease(RealLease):
    def __init__(self):
        time.sleep(0.3)
        super().__init__()
u.Lease = SlowLease
ch = u.UcxChannel(("127.0.0.1", 4))
def call():
    try:
        ch.request(b"h", None, time.monotonic() + 5, lambda p: 0)
    except OSError:
        pass
holders = u._Runtime._holders
t = threading.Thread(target=call)
t.start()
time.sleep(0.1)
ch.close()
t.join()
out["racing_lease_added"] = u._Runtime._holders - holders

# 5. a node's kept endpoints (peers that connect and never send) stay bounded.
u.MAX_KEPT_BY_NODE = 2
eps = [Ep() for _ in range(5)]
async def keep_all():
    for e in eps:
        u._quarantine(e, Req(), None)
u._run(keep_all(), time.monotonic() + 5)
out["node_kept"] = sum(k.addr is None for k in u._QUARANTINED)
out["node_freed"] = [e.aborted for e in eps]
print(json.dumps(out))
"""


def test_a_ucx_channel_closed_while_its_request_runs_frees_or_keeps_its_endpoint_rightly():
    """Four races of a channel's close() with its request (helpers' reviews): close() read
    whether a receive was posted on the caller's thread while the UCX loop posted it (the
    endpoint was freed under a stale receive, the failure _quarantine prevents); a connect
    finishing after close() left its endpoint open on a closed channel; a call after close()
    took a hold on the UCX runtime that nobody gave back, and so did one whose close() came
    from another thread as it took that hold. And a node's kept endpoints stay bounded."""
    r = subprocess.run([sys.executable, "-c", CHANNEL_RACES.format(repo=str(REPO))], capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["posted"] == {"freed": False, "kept": True}
    assert out["connected"]["freed"] and not out["connected"]["kept_ep"]
    assert out["connected"]["error"] and "closed" in out["connected"]["error"][0]
    assert "closed" in out["after_close"] and out["holders_added"] == 0
    assert out["racing_lease_added"] == 0
    assert out["node_kept"] == 2 and out["node_freed"] == [True, True, True, False, False]


# A fresh process: clients connected to a node that then stops answering; each one's request
# times out (its endpoint kept), and the node later answers or dies.
STALLED_NODE = r"""
import json, os, signal, sys, time
sys.path.insert(0, {repo!r})
import kvtier
import kvtier.net.ucx as u
from kvtier.net import PeerClient, PeerError
from tests.test_node import LAYOUT, NS, SECRET

pid, addr = {pid}, {addr!r}
seed = kvtier.keys.Keyer(NS, LAYOUT).seed
keys = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS).keys([1] * 32)
fds = lambda: len(os.listdir("/proc/self/fd"))
client = lambda t: PeerClient(addr, SECRET, seed, LAYOUT.block_bytes, t, transport="ucx")
first = client(2.0)
first.has(keys)
out = dict(start=fds())
clients = [client(0.3) for _ in range(4)]
for c in clients:
    c.has(keys)
out["connected"] = fds()
os.kill(pid, signal.SIGSTOP)
time.sleep(0.3)
for c in clients:
    try:
        c.has(keys)
    except PeerError:
        c.close()
out["kept"] = len(u._QUARANTINED)
fresh = client(0.3)
try:
    fresh.has(keys)
except PeerError as e:
    out["refused"] = e.reason
fresh.close()
os.kill(pid, signal.SIGCONT)
time.sleep(1.0)                         # the node answers the four requests, late
again = client(2.0)
out["answered"] = again.has(keys)
again.close()
out["kept_after"] = len(u._QUARANTINED)
deadline = time.monotonic() + 5         # UCX closes an aborted endpoint's sockets as it progresses
while fds() > out["start"] and time.monotonic() < deadline:
    time.sleep(0.05)
out["end"] = fds()
first.close()
print(json.dumps(out))
"""


def test_endpoints_kept_for_a_stalled_ucx_node_are_bounded_and_freed_when_it_answers(spawn):
    """Each request to a node that stopped answering left its endpoint open for the process's
    life (three descriptors each here): a peer that took connections and never answered
    piled them up. Now no new connection goes to a node while one kept for it waits, and a
    kept endpoint is freed once its late reply lands."""
    proc, addr = spawn(seeds=[1])
    try:
        r = subprocess.run([sys.executable, "-c", STALLED_NODE.format(repo=str(REPO), pid=proc.pid, addr=addr)],
                           capture_output=True, text=True, env=ENV, timeout=120)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["connected"] > out["start"] and out["kept"] == 4
    assert "has not answered" in out["refused"]
    assert out["answered"] == 4 and out["kept_after"] == 0
    assert out["end"] <= out["start"], out


def test_a_ucx_node_that_closed_an_idle_connection_still_answers_new_clients(children):
    """A node closing a connection whose receive for the next request was queued (its idle
    timeout) freed the endpoint under that receive: UCX gave the handle to the next
    connection, whose first request the stale receive took, so the node answered no client
    again (a helper's review; every fresh client's call was reset)."""
    code = NODE.format(repo=str(REPO), blocks=64, seeds=[1], tokens=32, secret=SECRET, transport="ucx").replace(
        "transport='ucx')", "transport='ucx', request_timeout=0.5, limits=kvtier.net.NodeLimits(idle_timeout=0.5))")
    assert "idle_timeout" in code
    _, addr = children(code, env=ENV)
    seed = kvtier.keys.Keyer(NS, LAYOUT).seed
    keys = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS).keys([1] * 32)
    idle = PeerClient(addr, SECRET, seed, LAYOUT.block_bytes, 2.0, transport="ucx")
    assert idle.has(keys) == 4
    time.sleep(1.5)                                  # the node closes it as idle
    for _ in range(3):
        fresh = PeerClient(addr, SECRET, seed, LAYOUT.block_bytes, 2.0, transport="ucx")
        assert fresh.has(keys) == 4
        fresh.close()
    assert idle.has(keys) == 4                       # its request freed the kept endpoint: reset, then retried
    idle.close()
