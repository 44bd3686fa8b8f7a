"""Nodes on loopback: blocks cross processes byte-exact; faults cost misses, never hangs or wrong KV."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.net import Node, PeerClient, PeerError
from kvtier.net.frames import PREFIX_BYTES, Frame, decode, read_prefix
from tests.conftest import REPO, payload

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)  # 8 KiB
NS = kvtier.Namespace("net-test", "r1")
SECRET = b"cluster-secret-0123456789abcdef"

NODE = r'''
import sys, time, torch, kvtier
sys.path.insert(0, {repo!r})
from tests.conftest import payload
layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
store = kvtier.Store(layout, [kvtier.HostTier(blocks={blocks})], kvtier.Namespace("net-test", "r1"))
for seed in {seeds!r}:
    keys = store.keys([seed] * {tokens})
    store.put(keys, payload(keys, layout.block_bytes))
node = kvtier.Node(store, "127.0.0.1:0", {secret!r}, transport={transport!r}).start()
print(node.address, flush=True)
time.sleep(120)
'''


@pytest.fixture
def spawn(children):
    """A node process holding the prompts of `seeds`; returns (process, address)."""
    def start(seeds, tokens=32, blocks=64):
        return children(NODE.format(repo=str(REPO), blocks=blocks, seeds=list(seeds), tokens=tokens, secret=SECRET,
                                    transport="tcp"))
    return start


def client_store(peers, secret=SECRET, ns=NS, timeout=0.5, host=64) -> kvtier.Store:
    return kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=host)], ns, remote=kvtier.Remote(peers, secret, timeout=timeout))


def assert_each_fetched(store, seeds):
    """Each seed's 4-block prompt arrives whole and byte-exact from whichever node holds it."""
    for seed in seeds:
        keys = store.keys([seed] * 32)
        loaded, out = fetch(store, keys)
        assert loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))


def fetch(store, keys):
    out = torch.zeros(len(keys), LAYOUT.block_bytes, dtype=torch.uint8)
    return store.get(keys, out).loaded, out


def test_two_nodes_exchange_blocks_byte_exact(spawn):
    _, addr = spawn(seeds=[1, 2])
    store = client_store([addr])
    keys = store.keys([1] * 32)
    hit = store.lookup(keys)
    assert hit.blocks == 4 and hit.by_tier() == {"host": 0, "remote": 4}
    loaded, out = fetch(store, keys)
    assert loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    assert store.lookup(keys).by_tier() == {"host": 4, "remote": 0}      # promoted: next time local
    assert store.stats().counters.remote_blocks == 4
    mixed = store.keys([2] * 16 + [7] * 16)                # the peer has half of it
    assert store.lookup(mixed).blocks == 2
    store.close()


def test_engine_pages_load_local_then_peer_blocks_in_one_pass(spawn):
    """load_into on host pages: the local prefix from host slots, the rest fetched from a
    peer into the store's read buffer, verified, then promoted locally."""
    from kvtier.adapter import KVAdapter
    from kvtier.transfer.pages import PagedKV

    _, addr = spawn(seeds=[3])
    store = client_store([addr])
    keys = store.keys([3] * 32)
    store.put(keys[:1], payload(keys[:1], LAYOUT.block_bytes))     # block 0 is here, 1-3 on the peer
    pages = [torch.zeros(8, LAYOUT.layer_bytes, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    paged = PagedKV.of_pages(pages, LAYOUT, num_pages=8)      # opaque pages: one layer of a block each
    adapter = KVAdapter(store)
    table = [[5], [0], [7], [2]]
    load = adapter.load_into(keys, paged, table)
    assert load.wait() == 4 and load.error is None
    want = payload(keys, LAYOUT.block_bytes)
    for i, (page,) in enumerate(table):
        assert torch.equal(torch.cat([pages[l][page] for l in range(LAYOUT.num_layers)]), want[i])
    assert store.lookup(keys).by_tier() == {"host": 4, "remote": 0}       # promoted
    assert store.stats().counters.remote_blocks == 3
    adapter.close()
    store.close()


def test_pages_in_kvtier_load_the_local_prefix_then_peer_blocks(spawn):
    """An engine whose pages are the device tier: the local block in place, the peer's
    blocks fetched (verified) and copied into newly allocated pages."""
    from kvtier.adapter import KVAdapter

    _, addr = spawn(seeds=[4])
    store = kvtier.Store(LAYOUT, [kvtier.DeviceTier(blocks=8, device="cpu"), kvtier.HostTier(blocks=16)], NS,
                         remote=kvtier.Remote([addr], SECRET, timeout=0.5))
    adapter = KVAdapter(store)
    tokens = [4] * 32
    keys = store.keys(tokens)
    want = payload(keys, LAYOUT.block_bytes)
    store.put(keys[:1], want[:1])                                  # block 0 here, blocks 1-3 on the peer
    match = adapter.lookup(tokens)
    assert match.tiers == ["device", "remote", "remote", "remote"]
    load = adapter.load(match)
    load.wait()
    assert load.blocks == 4 and load.cached == 1 and load.from_tiers == {"device": 1, "remote": 3}
    for i, page in enumerate(load.pages):
        assert torch.equal(store.tiers[0].tensor[page], want[i])
    adapter.cache(load.keys, load.pages)
    adapter.free(load.pages)
    assert store.lookup(keys).blocks == 4 and not store.pages.owned() and not store.pages.referenced()
    adapter.close()
    store.close()


def test_three_nodes_fetch_from_the_holder(spawn):
    _, a = spawn(seeds=[10])
    _, b = spawn(seeds=[20, 21])
    store = client_store([a, b])
    assert_each_fetched(store, (10, 20, 21))
    local = store.keys([10] * 16)                     # local prefix + remote suffix in one get
    longer = store.keys([10] * 16 + [99] * 16)
    assert store.lookup(longer).blocks == 2 and fetch(store, local)[0] == 2
    store.close()


def test_wrong_secret_and_other_namespace_are_refused(spawn):
    _, addr = spawn(seeds=[1])
    bad = client_store([addr], secret=b"not-the-cluster-secret-000000000")
    keys = bad.keys([1] * 32)
    assert bad.lookup(keys).blocks == 0 and bad.stats().remote["errors"] >= 1
    other = client_store([addr], ns=kvtier.Namespace("another-model"))
    assert other.lookup(other.keys([1] * 32)).blocks == 0 and other.stats().remote["errors"] >= 1
    good = client_store([addr])
    assert good.lookup(good.keys([1] * 32)).blocks == 4        # the node kept serving
    for s in (bad, other, good):
        s.close()


def test_a_node_killed_mid_get_keeps_the_verified_prefix_and_never_hangs(spawn):
    proc, addr = spawn(seeds=list(range(40)), tokens=8 * 64, blocks=40 * 64)   # 2,560 blocks, 20 MiB
    store = client_store([addr], timeout=0.5, host=4096)
    keys = [store.keys([s] * 8 * 64) for s in range(40)]
    assert store.lookup(keys[0]).blocks == 64
    result = {}

    def pull():
        got = []
        for k in keys:
            loaded, out = fetch(store, k)
            assert torch.equal(out[:loaded], payload(k[:loaded], LAYOUT.block_bytes))   # what counts is exact
            got.append(loaded)
        result["loaded"] = got

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    t.join(timeout=30)
    assert not t.is_alive(), "a get hung on a dead peer"
    loaded = result["loaded"]
    assert loaded[-1] == 0 and all(x in range(65) for x in loaded)
    assert store.lookup(keys[-1]).blocks == 0
    store.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            break
        data += more
    return data


class FakePeer:
    """A node that answers one GET with a valid header, then misbehaves."""

    def __init__(self, mode: str, keys, ns: bytes) -> None:
        self.mode, self.keys, self.ns = mode, keys, ns
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.srv.getsockname()[1]
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while True:          # each connection on a thread of its own, as a node serves them
            conn, _ = self.srv.accept()
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        bb = LAYOUT.block_bytes
        data = payload(self.keys, bb).numpy()
        try:
            while True:
                prefix = _recv_exact(conn, PREFIX_BYTES)
                if len(prefix) < PREFIX_BYTES:
                    break
                n = read_prefix(prefix, SECRET).length
                body = _recv_exact(conn, n + 32)
                req = decode(prefix, body[:n], body[n:], SECRET)
                k = len(self.keys)
                if req.op == "HAS":
                    conn.sendall(Frame("OK", self.ns, n=k, re=req.nonce).encode(SECRET))
                    continue
                sums = [xxhash.xxh3_64_intdigest(r) for r in data]
                if self.mode == "garbage":
                    data = data.copy()
                    data[2, 5] ^= 0xFF                    # block 2 arrives corrupted
                conn.sendall(Frame("OK", self.ns, n=k, payload=k * bb, sums=sums, re=req.nonce).encode(SECRET))
                if self.mode == "garbage":
                    conn.sendall(data.tobytes())
                elif self.mode == "stall":
                    conn.sendall(data[:1].tobytes())
                    time.sleep(5)                         # ... and nothing more
                elif self.mode == "die":
                    conn.sendall(data[:1].tobytes()[: bb // 2])
                    break
                elif self.mode == "die3":            # three whole blocks, half of the fourth
                    conn.sendall(data[:3].tobytes() + data[3].tobytes()[: bb // 2])
                    break
        except Exception:
            pass
        finally:
            conn.close()


@pytest.mark.parametrize("verify", ["inline", "thread"])
@pytest.mark.parametrize("mode,expect", [("stall", 1), ("die", 0), ("garbage", 2)])
def test_a_peer_that_stalls_dies_or_lies_costs_a_miss(mode, expect, verify, monkeypatch):
    """Within the deadline: the blocks that arrived verified before the fault (stall: one
    whole block then nothing; die: half a block; garbage: block 2 corrupted), never more;
    verified as they land or on the helper thread."""
    from kvtier.net import client as peer_client
    monkeypatch.setattr(peer_client, "INLINE_VERIFY_BYTES", 0)
    monkeypatch.setattr(peer_client, "VERIFY_THREAD", verify == "thread")
    probe = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    keys = probe.keys([5] * 32)
    peer = FakePeer(mode, keys, probe.keyer.seed)
    store = client_store([peer.address], timeout=0.3)
    t0 = time.monotonic()
    loaded, out = fetch(store, keys)
    assert time.monotonic() - t0 < 20, "the fetch outlived its deadline: a hang"    # (0.3 s + bytes at 100 MB/s)
    assert loaded == expect
    assert torch.equal(out[:loaded], payload(keys[:loaded], LAYOUT.block_bytes))
    assert store.lookup(keys).by_tier()["host"] == expect     # only verified blocks were kept


@pytest.mark.parametrize("verify", ["inline", "thread"])
def test_a_peer_dying_mid_get_gives_its_verified_prefix_everywhere(verify, monkeypatch):
    """PeerClient.get, Store.get and Store.reading all see the 3 blocks that arrived verified
    before the peer died part way through the 4th, whether blocks are verified as they land
    or on the helper thread (client.VERIFY_THREAD: machines with more than two cores)."""
    from kvtier.net import client as peer_client
    monkeypatch.setattr(peer_client, "INLINE_VERIFY_BYTES", 0)
    monkeypatch.setattr(peer_client, "VERIFY_THREAD", verify == "thread")
    probe = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    keys = probe.keys([6] * 32)
    want = payload(keys, LAYOUT.block_bytes)
    peer = FakePeer("die3", keys, probe.keyer.seed)
    with PeerClient.for_store(probe, peer.address, SECRET, timeout=2) as client:
        out = np.zeros((4, LAYOUT.block_bytes), dtype=np.uint8)
        assert client.get(keys, out) == 3 and np.array_equal(out[:3], want[:3].numpy())
        with pytest.raises(PeerError) as e:
            client.fetch(keys, out)         # the same failure, as an error that counts what came
        assert e.value.loaded == 3
    store = client_store([peer.address], timeout=2)
    loaded, out = fetch(store, keys)
    assert loaded == 3 and torch.equal(out[:3], want[:3])
    store.close()
    store = client_store([peer.address], timeout=2, host=8)
    with store.reading(keys, promote=False) as held:
        assert held.blocks == 3
    store.close()
    probe.close()


@pytest.fixture(scope="module")
def live_node():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS)
    keys = store.keys([3] * 32)
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    with Node(store, "127.0.0.1:0", SECRET) as node:
        yield node, keys


def _valid_frame(ns: bytes) -> bytes:
    return Frame("HAS", ns, [b"k" * 16]).encode(SECRET)


@given(junk=st.one_of(
    st.binary(min_size=1, max_size=200),
    st.tuples(st.integers(0, 300), st.integers(0, 255), st.booleans()).map(lambda t: ("mutate", *t)),
))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_frames_get_refused_and_the_node_keeps_serving(live_node, junk):
    node, keys = live_node
    if isinstance(junk, tuple):
        _, pos, byte, truncate = junk
        frame = bytearray(_valid_frame(node.seed))
        pos %= len(frame)
        frame[pos] = byte
        junk = bytes(frame[:pos + 1]) if truncate else bytes(frame)
    host, port = node.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as s:
        try:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass        # the node refused the frame and closed the connection first: as it should
    client = PeerClient(node.address, SECRET, node.seed, LAYOUT.block_bytes, timeout=2)
    assert client.has(keys) == 4
    client.close()


def test_peer_client_errors_are_peer_errors():
    probe = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    dead = PeerClient("127.0.0.1:1", SECRET, probe.keyer.seed, LAYOUT.block_bytes, timeout=0.2)
    with pytest.raises(PeerError):
        dead.has(probe.keys([1] * 8))
    with pytest.raises(kvtier.ConfigError, match="host:port|127.0.0.1:7700"):
        kvtier.Remote(["nohost"], SECRET)
    with pytest.raises(kvtier.ConfigError, match="16 bytes"):
        kvtier.Remote(["127.0.0.1:1"], b"short")
    with pytest.raises(kvtier.ConfigError, match="not a tier: pass it as Store"):
        kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4), kvtier.Remote(["127.0.0.1:1"], SECRET)], NS)
    with pytest.raises(kvtier.ConfigError, match="remote must be a kvtier.Remote"):
        kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS, remote="10.0.0.2:7700")


def test_kvtier_node_command_serves_and_stops(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b",
                          "--block-tokens", "16", "--capacity", "64MiB", "--model", "m", "--secret-file", str(secret)],
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert "serving 'm'" in line, line
        addr = line.rsplit(" on ", 1)[1].strip()
        store = kvtier.Store(kvtier.preset_layout("llama3-8b", 16), [kvtier.HostTier(blocks=8)], kvtier.Namespace("m"))
        client = PeerClient(addr, SECRET, store.keyer.seed, store.layout.block_bytes, timeout=5)
        keys = store.keys(list(range(64)))
        rows = payload(keys, store.layout.block_bytes).numpy()
        assert client.put(keys, rows) == 4 and client.has(keys) == 4
        out = np.zeros_like(rows)
        assert client.get(keys, out) == 4 and np.array_equal(out, rows)
        client.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0
    assert "served 3 requests" in p.stdout.read()
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "node"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "KVTIER_SECRET"})
    assert r.returncode == 2 and "shared secret" in r.stderr


def test_bench_transport_json():
    import json
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "transport", "--block-bytes", "1MiB",
                        "--total", "16MiB", "--repeat", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    row = next(x for x in rows if x["transport"] == "tcp")        # ucx too, where ucxx is installed
    assert (row["op"], row["blocks"]) == ("get", 16)
    assert row["gbps"] > 0 and row["baseline_gbps"] > 0


def test_a_down_peer_is_logged_once_backed_off_and_found_again(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % s.getsockname()[1]        # nothing listens here (yet)
    store = client_store([addr], timeout=0.3)
    keys = store.keys([3] * 32)
    with caplog.at_level("WARNING", logger="kvtier.remote"):
        for _ in range(200):                              # lookups at an engine's rate
            assert store.lookup(keys).blocks == 0
        assert store.stats().remote["errors"] == 200      # each a miss, counted
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 1 and f"peer {addr} unreachable" in msgs[0], msgs
        peer_store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
        peer_store.put(keys, payload(keys, LAYOUT.block_bytes))
        with Node(peer_store, addr, SECRET):
            deadline = time.monotonic() + 15
            while store.lookup(keys).blocks != 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert store.lookup(keys).blocks == 4             # retried within the 5 s backoff cap
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 2 and "reachable again" in msgs[1], msgs
    store.close()
    peer_store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_that_list_each_other_answer_only_their_own_blocks():
    """A node answers HAS and GET from its own tiers only: two nodes whose stores fetch from
    each other must not relay a miss back and forth (it used to loop until the deadline and
    leave each peer marked unreachable)."""
    pa, pb = _free_port(), _free_port()
    a = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS,
                     remote=kvtier.Remote([f"127.0.0.1:{pb}"], SECRET, timeout=2))
    b = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS,
                     remote=kvtier.Remote([f"127.0.0.1:{pa}"], SECRET, timeout=2))
    with Node(a, f"127.0.0.1:{pa}", SECRET) as na, Node(b, f"127.0.0.1:{pb}", SECRET):
        only_b = b.keys(list(range(100, 124)))
        b.put(only_b, payload(only_b, LAYOUT.block_bytes))
        nobody = a.keys(list(range(24)))
        with PeerClient.for_store(a, na.address, SECRET, timeout=5) as c:
            assert c.has(nobody) == 0
            assert c.has(only_b) == 0                       # b's blocks: not a's to serve
            assert c.get(only_b, np.zeros((3, LAYOUT.block_bytes), np.uint8)) == 0
        assert a.remote.errors == b.remote.errors == 0     # no relayed call timed out
        assert a.lookup(only_b).blocks == 3                # a's own lookups still ask b
        out = torch.zeros(3, LAYOUT.block_bytes, dtype=torch.uint8)
        assert a.get(only_b, out).loaded == 3 and torch.equal(out, payload(only_b, LAYOUT.block_bytes))
    a.close()
    b.close()


def test_find_answers_what_the_nodes_store_can_load_from_its_peers():
    """FIND (an engine's scheduler asking its own worker's node, in another process): the
    node's own prefix, then what its peers hold past it; two nodes that list each other
    still do not relay (peers are asked HAS), and a closed store is refused, not a hang."""
    pa, pb = _free_port(), _free_port()
    a = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS,
                     remote=kvtier.Remote([f"127.0.0.1:{pb}"], SECRET, timeout=2))
    b = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=16)], NS,
                     remote=kvtier.Remote([f"127.0.0.1:{pa}"], SECRET, timeout=2))
    with Node(a, f"127.0.0.1:{pa}", SECRET) as na, Node(b, f"127.0.0.1:{pb}", SECRET):
        keys = a.keys(list(range(40)))                      # 5 blocks
        a.put(keys[:2], payload(keys[:2], LAYOUT.block_bytes))
        b.put(keys[:4], payload(keys[:4], LAYOUT.block_bytes))
        nobody = a.keys(list(range(100, 124)))
        with PeerClient.for_store(a, na.address, SECRET, timeout=5) as c:
            assert c.has(keys) == 2                         # its own blocks only
            assert c.find(keys) == 4                        # and b's two past them
            assert c.find(nobody) == 0
            assert c.find([]) == 0
        assert a.remote.errors == b.remote.errors == 0
        out = torch.zeros(5, LAYOUT.block_bytes, dtype=torch.uint8)
        assert a.get(keys[:4], out[:4]).loaded == 4         # what FIND offered loads
        assert torch.equal(out[:4], payload(keys[:4], LAYOUT.block_bytes))
        a.close()
        with PeerClient.for_store(b, na.address, SECRET, timeout=5) as c, pytest.raises(PeerError, match="FIND refused"):
            c.find(keys)
    b.close()


def test_addresses_ipv6_in_brackets_and_no_port_0_for_a_peer():
    from kvtier.net.address import format_address, parse_address
    assert parse_address("10.0.0.2:7700") == ("10.0.0.2", 7700)
    assert parse_address("[::1]:7700") == ("::1", 7700)           # as bind and connect take it
    assert parse_address("[fe80::1%eth0]:7700") == ("fe80::1%eth0", 7700)
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)      # listen anywhere
    assert format_address("::1", 7700) == "[::1]:7700" and format_address("h", 1) == "h:1"
    for bad in ("[::1]", "[::1]7700", "[nohost]:7700", "fe80::1", "a b:1", "a,b:1", "h:65536", "h:x", ":7700"):
        with pytest.raises(kvtier.ConfigError, match="must look like|not a host"):
            parse_address(bad)
    with pytest.raises(kvtier.ConfigError, match="port 0"):
        parse_address("127.0.0.1:0", any_port=False)
    probe = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with pytest.raises(kvtier.ConfigError, match="port 0"):
        PeerClient.for_store(probe, "127.0.0.1:0", SECRET)
    with pytest.raises(kvtier.ConfigError, match="port 0"):
        kvtier.Remote(["127.0.0.1:0"], SECRET)
    with pytest.raises(kvtier.ConfigError, match="port 0"):
        Node(probe, "127.0.0.1:0", SECRET, advertise="10.0.0.1:0")


@pytest.mark.parametrize("host", ["no-such-host.invalid", "a..b"])
def test_a_host_a_node_cannot_listen_on_says_what_to_give(host):
    """An unresolvable host was a bare 'Name or service not known (while attempting to bind ...)'
    (create_server hides the lookup's error type), or an unexpected UnicodeError for `a..b`."""
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    node = Node(store, f"{host}:7700", SECRET)
    with pytest.raises(kvtier.ConfigError, match=rf"listen '{host}:7700': '{host}' is not an address .*0\.0\.0\.0"):
        node.start()
    node.stop()
    store.close()


def test_a_port_a_node_cannot_bind_is_named_with_what_to_do():
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(kvtier.ConfigError, match=rf"cannot listen on 127\.0\.0\.1:{port}: the port is in use"):
            Node(store, f"127.0.0.1:{port}", SECRET).start()
    store.close()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_a_node_serves_on_ipv6():
    """`[::1]:0` passed the address check, then failed to bind ('[::1]' is no host name)."""
    served = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    keys = served.keys([5] * 32)
    with Node(served, "[::1]:0", SECRET) as node:
        assert node.address.startswith("[::1]:")
        with PeerClient.for_store(served, node.address, SECRET, timeout=5) as c:
            assert c.put(keys, payload(keys, LAYOUT.block_bytes)) == 4 and c.has(keys) == 4
        fetching = client_store([node.address], timeout=5)
        assert fetch(fetching, keys)[0] == 4
        fetching.close()
    served.close()


def test_a_node_publishing_to_a_directory_needs_an_address_others_can_dial():
    """Listening on 0.0.0.0 (or ::) with a directory published 0.0.0.0:PORT: nobody could reach it."""
    from kvtier.net.directory import Directory, PeerList

    class Published(Directory):
        publishes = True

        def locate(self, keys):
            return []

    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    for listen in ("0.0.0.0:7750", "[::]:7750"):
        with pytest.raises(kvtier.ConfigError, match=r"advertise='HOST:PORT'"):
            Node(store, listen, SECRET, directory=Published())
        Node(store, listen, SECRET, directory=Published(), advertise="10.0.0.1:7750")   # fine: never started
        Node(store, listen, SECRET, directory=PeerList(["10.0.0.2:7700"]))          # publishes nothing
    store.close()


def test_a_secret_given_as_str_says_to_pass_bytes():
    from kvtier.net.push import Pusher
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    text = SECRET.decode()
    for make in (lambda: Node(store, "127.0.0.1:0", text), lambda: kvtier.Remote(["127.0.0.1:1"], text),
                 lambda: PeerClient.for_store(store, "127.0.0.1:1", text), lambda: Pusher(text)):
        with pytest.raises(kvtier.ConfigError, match=r"must be bytes, not str: pass secret.encode\(\)"):
            make()
    with pytest.raises(kvtier.ConfigError, match="at least 16 bytes, got 5"):
        Node(store, "127.0.0.1:0", b"short")
    store.close()


def test_a_lookup_never_waits_behind_a_fetch_and_a_busy_client_is_not_a_down_peer(spawn):
    """A FIND at a node asks its peers HAS while the node's loader may be fetching from the
    same peer: lookups have a client of their own, and a lookup that finds its own client
    busy at the deadline is a miss, not a failure of the peer (it was marked down before,
    and every lookup and load missed it until the backoff ended)."""
    _, addr = spawn(seeds=[5])
    store = client_store([addr], timeout=0.3)
    keys = store.keys([5] * 32)
    fetching = store.remote.client(addr)
    assert fetching._lock.acquire()                   # a long GET holds the fetch client
    try:
        assert store.lookup(keys).blocks == 4            # the lookup has a connection of its own
    finally:
        fetching._lock.release()
    looking = store.remote.client(addr, lookup=True)
    assert looking._lock.acquire()                    # now the lookup client itself is busy
    try:
        assert store.lookup(keys).blocks == 0            # a miss this once...
    finally:
        looking._lock.release()
    assert not store.remote.health(addr).down           # ...but the peer is not marked down
    assert store.lookup(keys).blocks == 4
    store.close()


def test_removals_a_failed_publish_round_lost_still_reach_the_directory():
    """A round whose directory call fails publishes everything next (after a lapse, too):
    that used to drop the failed round's removals, and the node stayed listed, beside the
    real holders, for blocks it had evicted (lookups picked it, and the fetch missed)."""
    from kvtier.net.directory import Directory, DirectoryError
    from kvtier.net.publisher import Publisher

    class Flaky(Directory):
        def __init__(self):
            self.calls, self.fail = [], 0

        def locate(self, keys):
            return []

        def publish(self, node, added, removed):
            if self.fail:
                self.fail -= 1
                raise DirectoryError("down for a moment")
            self.calls.append((sorted(added), sorted(removed)))

        def heartbeat(self, node):
            return True

        def leave(self, node, held=()):
            pass

    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    d = Flaky()
    pub = Publisher(store, d, "127.0.0.1:1")
    pub.round()
    keys = store.keys([7] * 32)
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    pub.round()
    assert d.calls[-1] == (sorted(keys), [])
    other = store.keys([8] * 48)                           # 6 blocks into 8 slots: evicts some of keys
    store.put(other, payload(other, LAYOUT.block_bytes))
    gone = sorted(set(keys) - set(store.cached_keys()))
    assert gone
    d.fail = 1
    pub.round()                                            # the removals' round fails
    pub.round()                                            # then everything is published again
    assert d.calls[-1] == (sorted(store.cached_keys()), gone)
    pub.round()
    assert d.calls[-1] == ([], [])                         # sent once
    store.close()
