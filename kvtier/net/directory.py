"""Who holds which block: the answer a remote tier needs before it fetches.

- PeerList: no service; ask every peer how long a prefix it holds (one round trip to
  each, in parallel). Fine for a handful of nodes.
- RedisDirectory: nodes publish the keys they hold to Redis (batched, pipelined) under a
  lease that expires when a node dies. Each block lists up to MAX_HOLDERS nodes, so a block
  stays findable while any listed node that holds it lives; a lookup of any number of keys
  is one round trip (a Lua script that also checks the holders' leases and prunes dead ones).
  A holder is a node's address and a token of its process, so a node restarted at the same
  address is not taken for the holder of what its last run published.
"""
from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from kvtier.ids import BlockKey as Key
from kvtier.errors import ConfigError, KvtierError
from kvtier.throttle import Throttle
from kvtier.net.address import parse_address
from kvtier.net.frames import RESP_NODE_PORT
from kvtier.net.health import Health

log = logging.getLogger("kvtier.directory")
T = TypeVar("T")
REDIS_SCHEMES = ("redis", "rediss", "unix")
MAX_HOLDERS = 4       # nodes listed per block (the latest publishers): bounds Redis memory per block
CHUNK = 1000          # block keys per script call: bounds how long one call holds Redis
LEAVE_CHUNKS = 16     # script calls per round trip when a stopping node removes itself
SWEEP_COUNT = 1000    # entries a sweep step reads (Redis's HSCAN COUNT hint)
TOKEN_KEEP_MS = 86_400_000   # how long Redis remembers which process an address last had
GARBLED_LOG_S = 60.0  # at most one log line per this many seconds about holder entries not UTF-8


class DirectoryError(KvtierError):
    """The directory could not be reached or answered wrongly: treat as a miss."""


class Directory(ABC):
    """Maps block keys to the nodes that hold them."""

    #: Whether publish() tells other nodes where blocks are (a node must then publish an
    #: address they can dial, not 0.0.0.0).
    publishes = False

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

    def leave(self, node: str, held: Sequence[Key] = ()) -> None:
        """`node` is going away: drop its lease, and its entries for the blocks `held`."""

    def sweep(self) -> int:
        """One step of clearing dead holders from entries no lookup reads; how many changed."""
        return 0

    def close(self) -> None:
        """Release connections and threads."""


class PeerList(Directory):
    """A fixed list of peers, asked directly."""

    def __init__(self, peers: Sequence[str]) -> None:
        if isinstance(peers, str) or not peers:
            raise ConfigError("peers must be a non-empty list of 'host:port' addresses")
        for p in peers:
            parse_address(p, any_port=False)
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


# Each block's entry in the namespace's hash lists its holders, oldest first, joined by ","
# (an address never holds one: kvtier/net/address.py). A lease key per node says it lives.
# Speed: one string field per block (not a Redis set per block) keeps a lookup of any
# length to one HMGET per 1,000 keys and a block's memory to one hash field; and since the
# blocks of a prompt mostly share one value ("A,B"), the scripts work out what each
# distinct value becomes once (`memo`), not once per block: Redis runs nothing else meanwhile.
_HELPERS = """
local alive = {}
local function live(h)
  local ok = alive[h]
  if ok == nil then
    ok = redis.call('EXISTS', KEYS[2] .. h) == 1
    alive[h] = ok
  end
  return ok
end
local memo = {}
local function holders(v)
  local t = memo[v]
  if t == nil then
    t = {}
    for h in string.gmatch(v, '[^,]+') do t[#t + 1] = h; t[h] = true end
    memo[v] = t
  end
  return t
end
local pruned = {}
local function living(v)          -- v's live holders (a list, a set, and t[0] joined by ',')
  local t = pruned[v]
  if t == nil then
    t = {}
    for _, h in ipairs(holders(v)) do if live(h) then t[#t + 1] = h; t[h] = true end end
    t[0] = table.concat(t, ',')
    pruned[v] = t
  end
  return t
end
local rewritten = {}
local function rewrite(v, fn)
  local out = rewritten[v]
  if out == nil then
    out = fn(holders(v))
    rewritten[v] = out
  end
  return out
end
"""

# KEYS[1]: the hash; KEYS[2]: the prefix of lease keys. ARGV: block keys in prefix order.
# Returns a live holder for each block of the longest prefix that has one. Dead holders are
# pruned from every entry read. The holder changes only where it must, to the one that
# holds the longest run from there (so a prefix is fetched in as few runs as its holders
# allow; each switch scans at most the run it picks, per candidate: linear in the keys).
_LOOKUP = _HELPERS + """
local lists, gap = {}, false
for s = 1, #ARGV, 1000 do
  local e = math.min(s + 999, #ARGV)
  local part = redis.call('HMGET', KEYS[1], unpack(ARGV, s, e))
  for i = 1, e - s + 1 do
    local v, here = part[i], nil
    if v then
      here = living(v)
      if here[0] == '' then redis.call('HDEL', KEYS[1], ARGV[s + i - 1])
      elseif here[0] ~= v then redis.call('HSET', KEYS[1], ARGV[s + i - 1], here[0]) end
    end
    if not here or here[0] == '' then gap = true end
    if not gap then lists[#lists + 1] = here end
  end
  if gap then break end
end
local out, cur, n = {}, nil, #lists
for i = 1, n do
  local here = lists[i]
  if not (cur and here[cur]) then
    cur = here[1]
    if #here > 1 then
      local best = 0
      for _, h in ipairs(here) do
        local j = i
        while j <= n and lists[j][h] do j = j + 1 end
        if j - i >= best then cur, best = h, j - i end   -- a tie: the newest holder (least likely stale)
      end
    end
  end
  out[i] = cur
end
return out
"""

# KEYS[1]: the hash; KEYS[2]: the prefix of lease keys. ARGV[1]: the node; ARGV[2]: holders
# listed per block at most; ARGV[3..]: blocks the node now holds. A full list drops its dead
# holders, then its oldest.
_ADD = _HELPERS + """
local node, cap = ARGV[1], tonumber(ARGV[2])
local function with_node(t)
  if t[node] then return false end
  local hs = {}
  for _, h in ipairs(t) do if #t < cap or live(h) then hs[#hs + 1] = h end end
  while #hs >= cap do table.remove(hs, 1) end
  hs[#hs + 1] = node
  return table.concat(hs, ',')
end
local vals = redis.call('HMGET', KEYS[1], unpack(ARGV, 3))
local set = {}
for i, v in ipairs(vals) do
  local new = node
  if v then new = rewrite(v, with_node) end
  if new then
    set[#set + 1] = ARGV[i + 2]
    set[#set + 1] = new
  end
end
if #set > 0 then redis.call('HSET', KEYS[1], unpack(set)) end
return #set / 2
"""

# KEYS[1]: the hash; KEYS[2]: the prefix of lease keys; KEYS[3]: the sweep's cursor. ARGV[1]:
# entries to read. One step of a walk over the whole hash that every node advances in turn:
# dead holders leave the entries read (a lookup prunes only the entries it reads, up to its
# first gap: a crashed node's blocks that nobody asks for again stayed for good).
_SWEEP = _HELPERS + """
local r = redis.call('HSCAN', KEYS[1], redis.call('GET', KEYS[3]) or '0', 'COUNT', ARGV[1])
local kv, changed = r[2], 0
for i = 1, #kv, 2 do
  local new = living(kv[i + 1])[0]
  if new == '' then redis.call('HDEL', KEYS[1], kv[i]); changed = changed + 1
  elseif new ~= kv[i + 1] then redis.call('HSET', KEYS[1], kv[i], new); changed = changed + 1 end
end
redis.call('SET', KEYS[3], r[1])
return changed
"""

# KEYS[1]: the hash. ARGV[1]: the node; ARGV[2..]: blocks it no longer holds. Only the node
# leaves each entry: the other holders stay listed.
_FORGET = _HELPERS + """
local node = ARGV[1]
local function without_node(t)
  if not t[node] then return false end
  local hs = {}
  for _, h in ipairs(t) do if h ~= node then hs[#hs + 1] = h end end
  return table.concat(hs, ',')
end
local vals = redis.call('HMGET', KEYS[1], unpack(ARGV, 2))
local set, del = {}, {}
for i, v in ipairs(vals) do
  local new = v and rewrite(v, without_node)
  if new == '' then del[#del + 1] = ARGV[i + 1]
  elseif new then set[#set + 1] = ARGV[i + 1]; set[#set + 1] = new end
end
if #del > 0 then redis.call('HDEL', KEYS[1], unpack(del)) end
if #set > 0 then redis.call('HSET', KEYS[1], unpack(set)) end
return #del + #set / 2
"""


def _chunks(keys: Sequence[Key], n: int = CHUNK) -> list[Sequence[Key]]:
    return [keys[i:i + n] for i in range(0, len(keys), n)]


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

    publishes = True

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
        except self._errors as e:
            if RESP_NODE_PORT in str(e):        # a node's answer to a Redis command (kvtier.net.frames)
                self.r.close()
                raise ConfigError(f"{self.url} is a kvtier node's port, not Redis: give --directory the Redis "
                                  "server's URL (a node's address goes in --peers)") from None
            # otherwise not answering yet: calls retry with backoff (logged at the first)
        self._lookup = self.r.register_script(_LOOKUP)
        self._add = self.r.register_script(_ADD)
        self._forget = self.r.register_script(_FORGET)
        self._sweep = self.r.register_script(_SWEEP)
        # This process's token: entries name a holder as address@token, and its lease key
        # too. A node restarted at the same address (a crash, a rolling restart) holds
        # another token, so what its last run published is dead, pruned, never chosen: a
        # fetch of it from the new process was a miss for blocks another holder had.
        self.token = os.urandom(4).hex()
        self.garbled = 0                  # holder entries read that were not UTF-8 (each a miss)
        self._garbled_warn = Throttle(GARBLED_LOG_S)

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
        self.tokens = f"kvtier:{ns.hex()}:token:"     # + address: the token of the process there now
        self.cursor = f"kvtier:{ns.hex()}:sweep"
        try:   # load the scripts now, so that even the first lookup is one round trip
            self._call(lambda: [self.r.script_load(code) for code in (_LOOKUP, _ADD, _FORGET, _SWEEP)])
        except DirectoryError:
            pass   # Redis is down for now (logged): the scripts load themselves on first use

    def holder(self, node: str) -> str:
        """How this process's node at address `node` is listed in entries and lease keys."""
        return f"{node}@{self.token}"

    def locate(self, keys: Sequence[Key]) -> list[str]:
        if not keys:
            return []
        found = self._call(lambda: self._lookup(keys=[self.hash, self.lease], args=list(keys)))
        out = []
        for h in found:
            try:
                out.append(h.decode().partition("@")[0])
            except UnicodeDecodeError:    # not an entry kvtier wrote: a miss from this block on
                self._garbled(h)
                break
        return out

    def _garbled(self, h: bytes) -> None:
        """Count a holder entry that is not UTF-8; logged at most once per GARBLED_LOG_S (a
        lookup hits it each time it reads that block: no log line per engine step)."""
        self.garbled += 1
        if self._garbled_warn.due(time.monotonic()):
            log.warning("%s: a block's holder entry is not UTF-8 (%r): taken as a miss (%d such entries read "
                        "so far; logged at most once every %g s)", self.health.what, h[:40], self.garbled,
                        GARBLED_LOG_S)

    def publish(self, node: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        """Add `node` to the holders of `added`, remove it from those of `removed`."""
        if added or removed:
            self._call(lambda: self._send(self.holder(node), added, removed))

    def _send(self, who: str, added: Sequence[Key], removed: Sequence[Key]) -> None:
        """Holder `who` added to the entries of `added`, taken off those of `removed`: one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for part in _chunks(added):
            self._add(keys=[self.hash, self.lease], args=[who, MAX_HOLDERS, *part], client=pipe)
        for part in _chunks(removed):
            self._forget(keys=[self.hash], args=[who, *part], client=pipe)
        pipe.execute()

    def heartbeat(self, node: str) -> bool:
        who = self.holder(node)
        if self._call(lambda: self.r.set(self.lease + who, b"1", px=self.lease_ms, get=True)) is not None:
            return True
        # A first heartbeat (or one after a lapse): this process is the node at `node` now.
        # The lease of a process that was there before ends at once, not lease_s later.
        # (The address's token outlives any lease it must end, then goes: addresses come and go.)
        before = self._call(lambda: self.r.set(self.tokens + node, self.token, get=True,
                                               px=max(self.lease_ms, TOKEN_KEEP_MS)))
        if before is not None and before.decode() != self.token:
            self._call(lambda: self.r.delete(self.lease + f"{node}@{before.decode()}"))
        return False

    def sweep(self) -> int:
        return int(self._call(lambda: self._sweep(keys=[self.hash, self.lease, self.cursor], args=[SWEEP_COUNT])))

    def leave(self, node: str, held: Sequence[Key] = ()) -> None:
        """Drop the lease first (lookups skip the node at once), then the node from the
        entries of `held`: LEAVE_CHUNKS script calls of CHUNK keys per round trip, so Redis
        serves others in between however much the node held."""
        who = self.holder(node)
        try:
            self._call(lambda: self.r.delete(self.lease + who))
            step = CHUNK * LEAVE_CHUNKS
            for i in range(0, len(held), step):
                self._call(lambda: self._send(who, (), held[i:i + step]))
        except DirectoryError:
            pass   # Redis is down: the lease runs out by itself, and lookups prune what they read

    def close(self) -> None:
        self.r.close()
