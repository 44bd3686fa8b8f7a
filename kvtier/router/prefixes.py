"""What the router believes each worker holds: an approximate prefix index.

The router cannot see token ids (it does not tokenize), so it keys what it sees: the
prompt's canonical bytes (the text, the token ids, or the chat messages' roles and
contents) cut into CHUNK-byte pieces, each hashed with everything before it (a chain, as
kvtier keys blocks). A worker is recorded as holding a prompt's chunks when the router
sends it the request; each worker's record is an LRU bounded to `capacity` chunks, which
stands in for its cache's eviction. Matching a prompt against a worker counts its leading
chunks present. It is approximate in both directions (the worker may have evicted a prefix
the router remembers, or hold one another router sent), the way SGLang's router and
Dynamo's router without KV events are; a wrong guess costs a recompute, never a wrong answer.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

CHUNK = 64                   # bytes per chunk
DEFAULT_CAPACITY = 1 << 16   # chunks remembered per worker (4 MiB of prompt text)


@dataclass
class Prompt:
    """A request's prompt as the router sees it: chain hashes of its chunks, its size in
    bytes, and its tokens when known (token-id prompts) or estimated."""

    hashes: list[bytes]
    size: int
    tokens: int | None = None
    keys: list[bytes] | None = None      # its block keys, as the workers key it (blocks.py), when known

    def tokens_of(self, nbytes: int, tokens_per_byte: float) -> int:
        """Tokens in the first `nbytes` bytes: proportional to the known count, else estimated."""
        if self.tokens is not None and self.size:
            return round(self.tokens * nbytes / self.size)
        return round(nbytes * tokens_per_byte)


def canonical(body: Any, chat: bool) -> tuple[bytes, int | None]:
    """The bytes a prompt is matched on, and its token count when it is token ids."""
    if not isinstance(body, dict):
        return b"", None
    if chat:
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else []:   # the worker answers a bad body its 400
            if isinstance(m, dict):
                content = m.get("content")
                if not isinstance(content, str):
                    content = orjson.dumps(content).decode()
                parts.append(f"{m.get('role')}\x1f{content}\x1e")
        return "".join(parts).encode(), None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt.encode(), None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # 4 bytes a token (ids past 2**32 wrap: the worker refuses them; this only routes)
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in prompt), len(prompt)
    return b"", None


def prompt_of(body: Any, chat: bool) -> Prompt:
    data, tokens = canonical(body, chat)
    hashes, h = [], b""
    for i in range(0, len(data) - len(data) % CHUNK, CHUNK):
        h = hashlib.blake2b(h + data[i:i + CHUNK], digest_size=8).digest()
        hashes.append(h)
    return Prompt(hashes, len(data), tokens)


class PrefixIndex:
    """Per worker, the chunk hashes it is believed to hold (LRU, bounded)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, worker: str, prompt: Prompt) -> int:
        """Leading bytes of `prompt` believed cached on `worker`."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for h in prompt.hashes:
            if h not in held:
                break
            n += 1
        return n * CHUNK

    def insert(self, worker: str, prompt: Prompt) -> None:
        held = self._held.setdefault(worker, OrderedDict())
        for h in prompt.hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def drop(self, worker: str) -> None:
        """The worker restarted or went away: it holds nothing the router knows of."""
        self._held.pop(worker, None)
