"""What a Redis directory reads that kvtier did not write: a miss, never an exception."""
from __future__ import annotations

import logging

import torch

import kvtier
from kvtier.net import RedisDirectory
from tests.test_redis_directory import server  # noqa: F401  (the fixture: a loopback redis-server)

SECRET = b"cluster-secret-0123456789abcdef"
LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)
NS = kvtier.Namespace("redis-entries", "r1")


def _listed(d: RedisDirectory, keys, holder: bytes) -> None:
    """Name `holder` (raw bytes) for `keys`, with a live lease so lookups keep it."""
    d.r.set(d.lease.encode() + holder, b"1")
    d.r.hset(d.hash, mapping={k: holder for k in keys})


def test_a_holder_entry_that_is_not_utf8_is_a_miss_logged_once(server, caplog):
    d = RedisDirectory(server.url)
    d.bind(b"n" * 16, lambda *_: 0)
    keys = [i.to_bytes(16, "big") for i in range(6)]
    d.heartbeat("10.0.0.1:7700")
    d.publish("10.0.0.1:7700", keys, [])
    _listed(d, keys[3:4], b"\xff\xfe:7700@x")
    with caplog.at_level(logging.WARNING, logger="kvtier.directory"):
        for _ in range(3):
            assert d.locate(keys) == ["10.0.0.1:7700"] * 3      # was: UnicodeDecodeError
    assert d.garbled == 3
    lines = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(lines) == 1, lines
    d.close()


def test_a_store_whose_directory_names_garbage_gets_a_miss(server):
    remote = kvtier.Remote(directory=RedisDirectory(server.url), secret=SECRET, timeout=0.5)
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8)], NS, remote=remote)
    d = remote.directory
    a, b = store.keys([1] * 32), store.keys([2] * 32)
    _listed(d, [bytes(k) for k in a], b"\xff@x")                 # not UTF-8
    _listed(d, [bytes(k) for k in b], b"nohost@x")               # not an address
    out = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    assert store.lookup(a).blocks == 0 and store.get(a, out).loaded == 0
    assert store.get(b, out).loaded == 0                           # was: ConfigError
    store.close()
