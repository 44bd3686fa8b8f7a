"""The UCX transport (ucxx): blocks cross node processes byte-exact; faults cost misses, never hangs."""
import os
import signal
import time

import pytest
import torch

import kvtier
from tests.conftest import REPO, payload
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
