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
from typing import Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from kvtier.ids import BlockKey as Key
from kvtier.errors import ConfigError, KvtierError
from kvtier.net.address import parse_address
from kvtier.net.health import Health

log = logging.getLogger("kvtier.directory")
T = TypeVar("T")
REDIS_SCHEMES = ("redis", "rediss", "unix")


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


def check_redis_url(url: str) -> str:
    """The URL without its password (for messages and logs) if `url` is a Redis URL kvtier
    can use: redis://[user:password@]host[:port][/db], rediss://... (TLS) or unix:///path.
    ConfigError otherwise; nothing is contacted."""
    example = "redis://10.0.0.9:6379 (or rediss://... for TLS, unix:///path/to/redis.sock)"
    if not isinstance(url, str):
        raise ConfigError(f"the Redis directory URL must be a string such as {example}")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ConfigError(f"Redis URL {url!r} is malformed ({e}): use {example}") from None
    if u.scheme not in REDIS_SCHEMES:
        raise ConfigError(f"Redis URL {url!r} must start with redis://, rediss:// or unix://: e.g. {example}")
    if u.scheme == "unix":
        if not u.path:
            raise ConfigError(f"Redis URL {url!r} names no socket: use unix:///path/to/redis.sock")
        return f"unix://{u.path}"
    if not u.hostname:
        raise ConfigError(f"Redis URL {url!r} names no host: use {example}")
    db = u.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(f"Redis URL {url!r}: the database after the host must be a number such as /0")
    user = f"{u.username}@" if u.username else ""
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{u.scheme}://{user}{host}{f':{port}' if port is not None else ''}{f'/{db}' if db else ''}"


class RedisDirectory(Directory):
    """`RedisDirectory("redis://127.0.0.1:6379", lease_s=10)`: a cluster's shared directory.

    While Redis does not answer, calls fail fast with a DirectoryError (a miss for the
    caller) and Redis is retried with backoff (kvtier/net/health.py): one log line when it
    goes away, one when it is back."""

    def __init__(self, url: str = "redis://127.0.0.1:6379", *, lease_s: float = 10.0, timeout: float = 0.5) -> None:
        try:
            import redis
        except ImportError as e:
            raise ConfigError("the Redis directory needs the redis package: pip install 'kvtier[cluster]'") from e
        if lease_s <= 0 or timeout <= 0:
            raise ConfigError("lease_s and timeout must be positive seconds")
        self.url = check_redis_url(url)      # without the password: it goes into messages
        self.lease_ms = int(lease_s * 1000)
        self._errors = (redis.RedisError, OSError)
        try:
            self.r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as e:   # redis-py's own checks of the URL's query options and the like
            raise ConfigError(f"Redis URL {self.url!r}: {e}") from None
        self._auth = tuple(getattr(redis.exceptions, n) for n in ("AuthenticationError", "AuthorizationError")
                           if hasattr(redis.exceptions, n))
        self.health = Health(f"Redis at {self.url}", log)
        try:      # wrong credentials are a setting to fix, not an outage to wait out
            self.r.ping()
        except self._auth as e:
            self.r.close()
            raise ConfigError(f"{self.health.what} refused the credentials: {self._why(e)}") from None
        except self._errors:
            pass  # not answering yet: calls retry with backoff (logged at the first)
        self._lookup = self.r.register_script(_LOOKUP)
        self._forget = self.r.register_script(_FORGET)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one Redis call, unless Redis is down and not due for a retry."""
        if not self.health.attempt():
            raise DirectoryError(f"{self.health.what} unreachable: next try in {self.health.retry_in():.1f} s")
        try:
            out = fn()
        except self._auth as e:       # e.g. the password changed on the server meanwhile
            self.health.failed(self._why(e), state="refusing the credentials")
            raise DirectoryError(f"{self.health.what} refused the credentials: {self._why(e)}") from None
        except self._errors as e:
            self.health.failed(str(e) or type(e).__name__)
            raise DirectoryError(f"{self.health.what}: {e}") from None
        self.health.succeeded()
        return out

    def _why(self, e: Exception) -> str:
        """Redis's refusal, with what to change (its own words name neither the URL nor the fix)."""
        has_password = self.r.connection_pool.connection_kwargs.get("password") is not None
        fix = ("check the password (and user) in the URL" if has_password else
               "put it in the URL, redis://:PASSWORD@host:port/0")
        said = str(e).rstrip(".") if has_password else "it asks for a password (none in the URL)"
        return f"{said or type(e).__name__}; {fix}"

    def bind(self, ns: bytes, ask: Callable[[str, Sequence[Key]], int]) -> None:
        super().bind(ns, ask)
        self.hash = f"kvtier:{ns.hex()}:blocks"
        self.lease = f"kvtier:{ns.hex()}:node:"
        try:   # load the scripts now, so that even the first lookup is one round trip
            self._call(lambda: (self.r.script_load(_LOOKUP), self.r.script_load(_FORGET)))
        except DirectoryError:
            pass   # Redis is down for now (logged): the scripts load themselves on first use

    def locate(self, keys: Sequence[Key]) -> list[str]:
        if not keys:
            return []
        return [h.decode() for h in self._call(lambda: self._lookup(keys=[self.hash, self.lease], args=list(keys)))]

    def publish(self, node: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        def send() -> None:
            pipe = self.r.pipeline(transaction=False)     # one round trip for the whole batch
            for i in range(0, len(added), 1000):
                pipe.hset(self.hash, mapping={k: node for k in added[i:i + 1000]})
            if removed:
                self._forget(keys=[self.hash], args=[node, *removed], client=pipe)
            pipe.execute()
        self._call(send)

    def heartbeat(self, node: str) -> bool:
        return self._call(lambda: self.r.set(self.lease + node, b"1", px=self.lease_ms, get=True)) is not None

    def leave(self, node: str) -> None:
        try:
            self._call(lambda: self.r.delete(self.lease + node))
        except DirectoryError:
            pass   # Redis is down: the lease runs out by itself

    def close(self) -> None:
        self.r.close()
