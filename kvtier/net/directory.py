"""Who holds which block: the answer a remote tier needs before it fetches.

- PeerList: no service; ask every peer how long a prefix it holds (one round trip to
  each, in parallel). Fine for a handful of nodes.
- RedisDirectory: nodes publish the keys they hold to Redis (batched, pipelined) under a
  lease that expires when a node dies; a lookup of any number of keys is one round trip
  (a Lua script that also checks the holders' leases and forgets dead holders' entries).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from kvtier.errors import ConfigError, KvtierError
from kvtier.net.address import parse_address

log = logging.getLogger("kvtier.directory")
Key = bytes


class DirectoryError(KvtierError):
    """The directory could not be reached or answered wrongly: treat as a miss."""


class Directory(ABC):
    """Maps block keys to the nodes that hold them."""

    def bind(self, ns: bytes, ask: Callable[[str, Sequence[Key]], int]) -> None:
        """Called by the remote tier: the namespace seed, and how to ask a peer HAS(keys)."""
        self.ns = ns
        self.ask = ask

    @abstractmethod
    def locate(self, keys: Sequence[Key]) -> list[str]:
        """The holder of each block of the longest prefix of `keys` held somewhere."""

    def publish(self, node: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        """`node` now holds `added` and no longer holds `removed`."""

    def heartbeat(self, node: str) -> bool:
        """Renew `node`'s lease; False if it had lapsed (the node must publish everything again)."""
        return True

    def leave(self, node: str) -> None:
        """`node` is going away: drop its lease."""

    def close(self) -> None:
        """Release connections and threads."""


class PeerList(Directory):
    """A fixed list of peers, asked directly."""

    def __init__(self, peers: Sequence[str]) -> None:
        if isinstance(peers, str) or not peers:
            raise ConfigError("peers must be a non-empty list of 'host:port' addresses")
        for p in peers:
            parse_address(p)
        self.peers = list(peers)
        self._pool = ThreadPoolExecutor(len(self.peers), thread_name_prefix="kvtier-peers")

    def locate(self, keys: Sequence[Key]) -> list[str]:
        if not keys:
            return []
        answers = list(self._pool.map(lambda p: self.ask(p, keys), self.peers))
        best = max(range(len(answers)), key=answers.__getitem__)
        return [self.peers[best]] * answers[best]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# KEYS[1]: the namespace's hash (key -> holder); KEYS[2]: the prefix of lease keys.
# ARGV: block keys in prefix order. Returns the holders of the longest held prefix.
_LOOKUP = """
local out = {}
local alive = {}
for s = 1, #ARGV, 1000 do
  local part = redis.call('HMGET', KEYS[1], unpack(ARGV, s, math.min(s + 999, #ARGV)))
  for i, h in ipairs(part) do
    if not h then return out end
    local ok = alive[h]
    if ok == nil then
      ok = redis.call('EXISTS', KEYS[2] .. h) == 1
      alive[h] = ok
    end
    if not ok then
      redis.call('HDEL', KEYS[1], ARGV[s + i - 1])
      return out
    end
    out[#out + 1] = h
  end
  if #part < math.min(1000, #ARGV - s + 1) then return out end
end
return out
"""

# KEYS[1]: the hash; ARGV[1]: the node; ARGV[2..]: keys it no longer holds (deleted only if
# the directory still names this node: another node may have published them since).
_FORGET = """
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 0
"""


class RedisDirectory(Directory):
    """`RedisDirectory("redis://127.0.0.1:6379", lease_s=10)`: a cluster's shared directory."""

    def __init__(self, url: str = "redis://127.0.0.1:6379", *, lease_s: float = 10.0, timeout: float = 0.5) -> None:
        try:
            import redis
        except ImportError as e:
            raise ConfigError("the Redis directory needs the redis package: pip install 'kvtier[cluster]'") from e
        if lease_s <= 0 or timeout <= 0:
            raise ConfigError("lease_s and timeout must be positive seconds")
        self.url = url
        self.lease_ms = int(lease_s * 1000)
        self._errors = (redis.RedisError, OSError)
        self.r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._lookup = self.r.register_script(_LOOKUP)
        self._forget = self.r.register_script(_FORGET)

    def bind(self, ns: bytes, ask: Callable[[str, Sequence[Key]], int]) -> None:
        super().bind(ns, ask)
        self.hash = f"kvtier:{ns.hex()}:blocks"
        self.lease = f"kvtier:{ns.hex()}:node:"
        try:   # load the scripts now, so that even the first lookup is one round trip
            self.r.script_load(_LOOKUP)
            self.r.script_load(_FORGET)
        except self._errors:
            pass   # Redis is down for now: the scripts load themselves on first use

    def locate(self, keys: Sequence[Key]) -> list[str]:
        if not keys:
            return []
        try:
            return [h.decode() for h in self._lookup(keys=[self.hash, self.lease], args=list(keys))]
        except self._errors as e:
            raise DirectoryError(f"directory {self.url}: {e}") from None

    def publish(self, node: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        try:
            pipe = self.r.pipeline(transaction=False)     # one round trip for the whole batch
            for i in range(0, len(added), 1000):
                pipe.hset(self.hash, mapping={k: node for k in added[i:i + 1000]})
            if removed:
                self._forget(keys=[self.hash], args=[node, *removed], client=pipe)
            pipe.execute()
        except self._errors as e:
            raise DirectoryError(f"directory {self.url}: {e}") from None

    def heartbeat(self, node: str) -> bool:
        try:
            return self.r.set(self.lease + node, b"1", px=self.lease_ms, get=True) is not None
        except self._errors as e:
            raise DirectoryError(f"directory {self.url}: {e}") from None

    def leave(self, node: str) -> None:
        try:
            self.r.delete(self.lease + node)
        except self._errors:
            pass

    def close(self) -> None:
        self.r.close()
