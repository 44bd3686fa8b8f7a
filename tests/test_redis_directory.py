"""The Redis directory, against a real redis-server on loopback (started here, stopped after)."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import kvtier
from kvtier.net import PeerClient, RedisDirectory
from tests.conftest import REPO, payload

redis = pytest.importorskip("redis", reason="the redis package is in the test extra: pip install -e '.[test]'")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (.ci/run installs it with apt)", allow_module_level=True)

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
NS = kvtier.Namespace("redis-test", "r1")
SECRET = b"cluster-secret-0123456789abcdef"


class RedisServer:
    def __init__(self, password: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", *auth], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, password=self.password).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def server():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


NODE = r'''
import sys, time, torch, kvtier
sys.path.insert(0, {repo!r})
from tests.conftest import payload
layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
store = kvtier.Store(layout, [kvtier.HostTier(blocks={blocks})], kvtier.Namespace("redis-test", "r1"))
for seed in {seeds!r}:
    keys = store.keys([seed] * 32)
    store.put(keys, payload(keys, layout.block_bytes))
node = kvtier.Node(store, "127.0.0.1:0", {secret!r},
                   directory=kvtier.RedisDirectory({url!r}, lease_s={lease})).start()
print(node.address, flush=True)
for line in sys.stdin:            # "put SEED": store another prompt (evicting as it must)
    keys = store.keys([int(line.split()[1])] * 32)
    store.put(keys, payload(keys, layout.block_bytes))
    print("ok", flush=True)
'''


def spawn_node(children, url: str, seeds, blocks: int = 64, lease: float = 10.0):
    code = NODE.format(repo=str(REPO), blocks=blocks, seeds=list(seeds), secret=SECRET, url=url, lease=lease)
    return children(code, stdin=True)


def client(url: str) -> kvtier.Store:
    remote = kvtier.Remote(directory=RedisDirectory(url), secret=SECRET, timeout=1.0)
    return kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=64)], NS, remote=remote)


def wait_for(cond, secs: float = 5.0) -> bool:
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_long_prompt_is_one_round_trip(server):
    d = RedisDirectory(server.url)
    d.bind(b"n" * 16, lambda *_: 0)
    keys = [i.to_bytes(16, "big") for i in range(8192)]       # a 128k-token prompt at 16 tokens a block
    assert d.heartbeat("10.0.0.1:7700") is False             # first time: no lease yet
    d.publish("10.0.0.1:7700", keys[:5000], [])
    sent = []                                                # every request this client sends
    real = d.r.execute_command
    d.r.execute_command = lambda *a, **k: (sent.append(a[0]), real(*a, **k))[1]
    holders = d.locate(keys)
    assert holders == ["10.0.0.1:7700"] * 5000
    assert sent == ["EVALSHA"]                               # one round trip for 8,192 keys
    d.r.execute_command = real
    d.publish("10.0.0.1:7700", [], keys[:10])                  # removals only touch this node's entries
    assert d.locate(keys) == []
    d.close()


def bound(url: str) -> RedisDirectory:
    d = RedisDirectory(url)
    d.bind(b"n" * 16, lambda *_: 0)
    return d


def entries(d: RedisDirectory, keys) -> list[str]:
    """Each key's entry in the namespace's hash: its holders' addresses (without their
    processes' tokens) joined by commas."""
    return [",".join(h.partition("@")[0] for h in v.decode().split(",")) if v else ""
            for v in d.r.hmget(d.hash, keys)]


def test_every_live_holder_of_a_block_stays_findable(server):
    """Two nodes hold the same blocks: the second to publish no longer replaces the first, a
    node that drops blocks takes only itself off them, and when one dies the other is found
    (the second publisher used to own every entry: its death made the blocks unfindable,
    though the first still held them)."""
    d = bound(server.url)
    keys = [i.to_bytes(16, "big") for i in range(20)]
    for node in ("10.0.0.1:7700", "10.0.0.2:7700"):
        d.heartbeat(node)
        d.publish(node, keys, [])
    d.publish("10.0.0.1:7700", keys, [])                       # everything again (after a lapse): no change
    assert entries(d, keys) == ["10.0.0.1:7700,10.0.0.2:7700"] * 20
    assert d.locate(keys) == ["10.0.0.2:7700"] * 20           # a tie goes to the newest holder (a node
                                                              # restarted empty at an old address is the oldest)
    d.publish("10.0.0.1:7700", [], keys[10:])                 # A evicts its last ten
    assert d.locate(keys) == ["10.0.0.2:7700"] * 20           # one run from B, not A then B
    assert entries(d, keys[10:]) == ["10.0.0.2:7700"] * 10
    d.publish("10.0.0.1:7700", keys[10:], [])
    d.r.delete(d.lease + d.holder("10.0.0.2:7700"))                      # B dies: its lease ends
    assert d.locate(keys) == ["10.0.0.1:7700"] * 20
    assert entries(d, keys) == ["10.0.0.1:7700"] * 20           # and the lookup pruned it everywhere
    d.close()


def test_a_lookup_prunes_dead_holders_from_every_entry_it_reads(server):
    d = bound(server.url)
    keys = [i.to_bytes(16, "big") for i in range(30)]
    for node, held in (("10.0.0.1:7700", keys[:10]), ("10.0.0.9:7700", keys)):
        d.heartbeat(node)
        d.publish(node, held, [])
    d.r.delete(d.lease + d.holder("10.0.0.9:7700"))
    assert d.locate(keys) == ["10.0.0.1:7700"] * 10
    assert entries(d, keys) == ["10.0.0.1:7700"] * 10 + [""] * 20     # past the gap too
    d.close()


def test_a_node_restarted_at_its_address_is_not_the_holder_of_its_last_runs_blocks(server):
    """A node crashes and comes back empty at the same address (a rolling restart): the
    blocks its last run published are another live node's to serve. It renewed the same
    lease, so lookups kept choosing it (the newest holder) and every fetch from it missed."""
    a, b = "10.0.0.1:7700", "10.0.0.2:7700"
    first, other = bound(server.url), bound(server.url)      # A's first process; B
    keys = [i.to_bytes(16, "big") for i in range(10)]
    other.heartbeat(b)
    other.publish(b, keys, [])
    first.heartbeat(a)
    first.publish(a, keys, [])
    assert first.locate(keys) == [a] * 10                     # the newest holder
    again = bound(server.url)                                 # A's next process, after a SIGKILL
    assert again.heartbeat(a) is False                        # a fresh lease: publish everything
    again.publish(a, keys[:2], [])                            # it recovered 2 blocks from its disk
    # The old run's lease ended at the new run's first heartbeat, not lease_s later: B is
    # chosen (it holds the longest run), and the lookup took the old run off every entry.
    assert again.locate(keys) == [b] * 10
    assert entries(again, keys) == [f"{b},{a}"] * 2 + [b] * 8
    for d in (first, other, again):
        d.close()


def test_a_sweep_clears_dead_holders_past_any_lookups_gap(server):
    """Entries past a lookup's first gap were never pruned: a crashed node's blocks that
    nobody asks for again stayed in Redis for good. Sweep steps walk the whole hash."""
    d = bound(server.url)
    live, dead = "10.0.0.1:7700", "10.0.0.9:7700"
    keys = [i.to_bytes(16, "big") for i in range(5000)]
    d.heartbeat(live)
    d.publish(live, keys[:100], [])
    d.heartbeat(dead)
    d.publish(dead, keys, [])
    d.r.delete(d.lease + d.holder(dead))
    assert d.locate(keys[100:]) == []                          # the gap: the lookup prunes its first chunk only
    assert d.r.hlen(d.hash) > 1000
    for _ in range(100):                                       # steps of ~SWEEP_COUNT entries, any node's
        d.sweep()
        if d.r.get(d.cursor) == b"0":
            break
    assert d.r.get(d.cursor) == b"0"                           # a whole pass
    assert d.r.hlen(d.hash) == 100 and entries(d, keys[:100]) == [live] * 100
    assert d.locate(keys) == [live] * 100
    d.close()


def test_a_running_node_takes_steps_of_the_sweep(server, monkeypatch):
    from kvtier.net import publisher
    monkeypatch.setattr(publisher, "SWEEP_EVERY", 0.05)
    st = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS)
    node = kvtier.Node(st, "127.0.0.1:0", SECRET, directory=RedisDirectory(server.url)).start()
    d = bound(server.url)
    d.hash, d.lease = f"kvtier:{st.keyer.seed.hex()}:blocks", f"kvtier:{st.keyer.seed.hex()}:node:"
    keys = [i.to_bytes(16, "big") for i in range(3000)]
    d.heartbeat("10.0.0.9:7700")
    d.publish("10.0.0.9:7700", keys, [])
    d.r.delete(d.lease + d.holder("10.0.0.9:7700"))            # it died; nobody looks its blocks up
    try:
        assert wait_for(lambda: d.r.hlen(d.hash) == 0, secs=10)
    finally:
        node.stop()
        st.close()
        d.close()


def test_holders_per_block_are_capped_dead_ones_dropped_first(server):
    d = bound(server.url)
    keys = [b"k" * 16]
    nodes = [f"10.0.0.{i}:7700" for i in range(1, 8)]
    for node in nodes[:6]:
        d.heartbeat(node)
        d.publish(node, keys, [])
    assert entries(d, keys) == [",".join(nodes[2:6])]          # MAX_HOLDERS, the latest publishers
    d.r.delete(d.lease + d.holder(nodes[4]))
    d.heartbeat(nodes[6])
    d.publish(nodes[6], keys, [])
    assert entries(d, keys) == [",".join(nodes[2:4] + nodes[5:7])]   # the dead one made room
    d.close()


def test_a_node_that_stops_leaves_its_entries_to_the_other_holders(server):
    """Nodes A and B hold the same 20 blocks; B stops cleanly: a store still finds all 20 on
    A, and B is off every entry at once; once A stops too, nothing of either is left in Redis
    (a stop used to drop only the lease, leaving every entry behind)."""
    stores = [kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=32)], NS) for _ in range(2)]
    keys = stores[0].keys(list(range(8 * 20)))
    nodes = []
    for st in stores:
        st.put(keys, payload(keys, LAYOUT.block_bytes))
        nodes.append(kvtier.Node(st, "127.0.0.1:0", SECRET, directory=RedisDirectory(server.url, lease_s=3)).start())
    a, b = nodes
    store = client(server.url)
    d = bound(server.url)
    d.hash = f"kvtier:{store.keyer.seed.hex()}:blocks"
    assert wait_for(lambda: store.lookup(keys).blocks == 20 and all(b.address in e for e in entries(d, keys)))
    b.stop()
    assert store.lookup(keys).by_tier() == {"host": 0, "remote": 20}
    with PeerClient.for_store(store, a.address, SECRET) as c:
        assert c.has(keys) == 20
    assert entries(d, keys) == [a.address] * 20
    a.stop()
    assert d.r.hlen(d.hash) == 0
    for st in (store, *stores):
        st.close()
    d.close()


def test_blocks_found_through_redis_and_fetched_byte_exact(server, children):
    p, addr = spawn_node(children, server.url, seeds=[1, 2])
    store = client(server.url)
    keys = store.keys([1] * 32)
    assert wait_for(lambda: store.lookup(keys).blocks == 4)
    assert store.lookup(keys).by_tier() == {"host": 0, "remote": 4}
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    assert store.get(keys, out).loaded == 4 and torch.equal(out, payload(keys, LAYOUT.block_bytes))
    assert store.lookup(keys).by_tier() == {"host": 4, "remote": 0}
    store.close()


def test_evicted_blocks_leave_the_directory(server, children):
    p, addr = spawn_node(children, server.url, seeds=[1], blocks=4)
    store = client(server.url)
    old = store.keys([1] * 32)
    assert wait_for(lambda: store.lookup(old).blocks == 4)
    p.stdin.write("put 7\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "ok"             # the node's 4 slots now hold seed 7
    assert wait_for(lambda: store.lookup(old).blocks == 0)
    r = redis.Redis(port=server.port)
    assert wait_for(lambda: r.hlen(f"kvtier:{store.keyer.seed.hex()}:blocks") == 4)
    store.close()


def test_a_dead_node_drops_out_when_its_lease_ends(server, children):
    p, addr = spawn_node(children, server.url, seeds=[3], lease=1.0)
    store = client(server.url)
    keys = store.keys([3] * 32)
    assert wait_for(lambda: store.lookup(keys).blocks == 4)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert wait_for(lambda: store.lookup(keys).blocks == 0, secs=10)     # once the 1 s lease ends
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    assert store.get(keys, out).loaded == 0
    store.close()


def test_a_redis_restart_is_refilled_by_the_nodes(server, children):
    p, addr = spawn_node(children, server.url, seeds=[4], lease=1.0)
    store = client(server.url)
    keys = store.keys([4] * 32)
    assert wait_for(lambda: store.lookup(keys).blocks == 4)
    server.stop()                                          # everything Redis knew is gone
    assert store.lookup(keys).blocks == 0 and store.stats().remote["errors"] >= 1   # a miss, no crash
    server.start()
    assert wait_for(lambda: store.lookup(keys).blocks == 4, secs=10)   # the node published again
    store.close()


def test_kvtier_node_with_a_directory(server, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b",
                          "--capacity", "64MiB", "--model", "m", "--secret-file", str(secret),
                          "--directory", server.url, "--lease", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert "serving 'm'" in p.stdout.readline()
        r = redis.Redis(port=server.port)
        assert wait_for(lambda: any(k.startswith(b"kvtier:") and b":node:" in k for k in r.keys()))
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 0


def closed_port_url() -> str:
    with socket.socket() as s:          # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}"


def test_redis_down_is_logged_once_and_retried_with_backoff(caplog):
    d = RedisDirectory(closed_port_url())
    d.bind(b"n" * 16, lambda *_: 0)
    sent = []
    real = d.r.execute_command
    d.r.execute_command = lambda *a, **k: (sent.append(a[0]), real(*a, **k))[1]
    calls = 0
    t_end = time.monotonic() + 2.0
    with caplog.at_level("DEBUG", logger="kvtier"):
        while time.monotonic() < t_end:          # a publisher renews every 50 ms; lookups come at any rate
            with pytest.raises(kvtier.net.DirectoryError):
                d.heartbeat("10.0.0.1:7700")
            calls += 1
            time.sleep(0.005)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "unreachable" in warnings[0] and d.url in warnings[0], warnings
    assert calls > 100 and 1 <= len(sent) <= 8, (calls, len(sent))   # 0.1 s doubling to 5 s: a handful of tries
    d.close()


def test_kvtier_node_with_redis_down_says_so_once():
    url = closed_port_url()
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b",
                          "--capacity", "64MiB", "--model", "m", "--directory", url],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "KVTIER_SECRET": SECRET.decode()})
    try:
        assert "serving 'm'" in p.stdout.readline()
        time.sleep(3)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"Redis at {url} unreachable" in lines[0], err


def test_kvtier_node_started_before_redis_publishes_once_it_is_up():
    srv = RedisServer()                   # a port, no server yet
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b",
                          "--capacity", "64MiB", "--model", "m", "--directory", srv.url],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "KVTIER_SECRET": SECRET.decode()})
    try:
        assert "serving 'm'" in p.stdout.readline()
        assert "unreachable" in p.stderr.readline()
        srv.start()
        assert "reachable again" in p.stderr.readline()        # the next line: nothing in between
        r = redis.Redis(port=srv.port)
        assert wait_for(lambda: any(b":node:" in k for k in r.keys()), secs=10)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        srv.stop()
    assert p.returncode == 0 and err == "", err


def test_wrong_or_missing_redis_password_is_a_clear_error_at_start(tmp_path):
    """A password Redis refuses is a setting to fix: `kvtier node` stops at once with one
    line saying so (it logged "unreachable ... retrying" forever before); the right one works;
    a password changed on the server later is logged as refused credentials, not an outage."""
    srv = RedisServer(password="right-one")
    srv.start()
    try:
        url = f"redis://127.0.0.1:{srv.port}"
        for given, says in ((f"redis://:wrong@127.0.0.1:{srv.port}", "check the password"),
                            (url, "it asks for a password (none in the URL)")):
            p = subprocess.run([sys.executable, "-m", "kvtier.cli", "node", "--listen", "127.0.0.1:0",
                                "--layout", "llama3-8b", "--capacity", "64MiB", "--model", "m", "--directory", given],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, "KVTIER_SECRET": SECRET.decode()})
            lines = p.stderr.strip().splitlines()
            assert p.returncode != 0 and len(lines) == 1, p.stderr
            assert lines[0].startswith(f"kvtier: error: Redis at {url} refused the credentials") and says in lines[0]
            assert "wrong" not in lines[0], "the password never goes into messages"
        d = RedisDirectory(f"redis://:right-one@127.0.0.1:{srv.port}")
        d.bind(b"n" * 16, lambda *_: 0)
        assert d.heartbeat("10.0.0.1:7700") is False          # works: a new lease
        redis.Redis(port=srv.port, password="right-one").config_set("requirepass", "changed")
        d.r.connection_pool.disconnect()
        with pytest.raises(kvtier.net.DirectoryError, match="refused the credentials"):
            d.heartbeat("10.0.0.1:7700")
        d.close()
    finally:
        srv.stop()


def test_a_disaggregated_workers_directory_sweeps_through_its_base(server):
    """A P/D worker's node publishes through a HandoffDirectory around the Redis one: its
    sweep steps must reach Redis (the base class's sweep does nothing)."""
    from kvtier.net.handoff import HandoffDirectory
    d = bound(server.url)
    keys = [i.to_bytes(16, "big") for i in range(50)]
    d.heartbeat("10.0.0.9:7700")
    d.publish("10.0.0.9:7700", keys, [])
    d.r.delete(d.lease + d.holder("10.0.0.9:7700"))
    hd = HandoffDirectory(d)
    assert hd.sweep() == 50 and d.r.hlen(d.hash) == 0
    hd.close()
