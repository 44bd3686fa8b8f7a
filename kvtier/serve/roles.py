"""Settings of a prefill or decode worker's kvtier node: where it listens and its secret.

A P/D pair on one host needs no link options: the node listens on the HTTP port + 1000
(so workers on ports 8000, 8001, ... get nodes on 9000, 9001, ...; --port 0 gets a free
node port), and without --secret-file or $KVTIER_SECRET a built-in development secret is
used, with a loud warning: it authenticates nothing, since everyone knows it.

The same secret signs what workers tell each other through the router (which holds no
secret and passes signatures on unchanged): a prefill worker's hand-over (the node to pull
from and the block keys) and a decode worker's node that prefill workers may push to. A
worker acts on neither unless its signature checks, so whoever reaches a worker's HTTP port
cannot make it dial an address of their choosing.
"""
from __future__ import annotations

import hashlib
import hmac
import socket
import sys
from typing import Any, Sequence

from kvtier.errors import ConfigError

NODE_PORT_OFFSET = 1000
DEV_SECRET = b"kvtier-development-secret-INSECURE"
HANDOFF = b"kvtier hand-over"        # signed by a prefill worker: its node and the prompt's block keys
PUSH_TARGET = b"kvtier push target"  # signed by a decode worker: its node, which prefill workers may push to
CLUSTER_ID = b"kvtier cluster id"    # signed by every worker: nothing, so equal secrets give equal ids
WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def node_listen_default(host: str, http_port: int) -> str:
    """The node's address for an HTTP server on `host`:`http_port`."""
    port = http_port + NODE_PORT_OFFSET if 0 < http_port <= 65535 - NODE_PORT_OFFSET else 0
    return f"{host}:{port}"


def check_node_listen(listen: str, _http_port: int = 0) -> str:
    """`listen` if it can be bound now (so a busy node port is an error before the model loads)."""
    from kvtier.net.address import parse_address

    host, port = parse_address(listen)
    if port == 0:
        return listen
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except OSError as e:
        raise ConfigError(f"the kvtier node cannot listen on {listen}: {e.strerror or e}; pick another "
                          "--node-listen (or --port: the node's default port is the HTTP port + "
                          f"{NODE_PORT_OFFSET})") from None
    return listen


def role_secret(path: str | None) -> bytes:
    """The cluster secret (--secret-file, $KVTIER_SECRET), else the development one, loudly."""
    import os

    from kvtier.node_cli import read_secret

    if path or os.environ.get("KVTIER_SECRET"):
        return read_secret(path)
    print("kvtier serve: WARNING: INSECURE: no --secret-file and no $KVTIER_SECRET, so the kvtier node uses the "
          "built-in development secret; anyone who can reach the node's port can read and overwrite this "
          "server's KV blocks. Use it on one trusted host only; give every worker the same --secret-file "
          "in production.", file=sys.stderr, flush=True)
    return DEV_SECRET


def signing_key(secret: bytes) -> bytes:
    """The key workers sign hand-overs with: derived from the cluster secret, apart from the
    node protocol's keys (a signature is never a valid frame tag, nor the reverse)."""
    return hmac.new(bytes(secret), b"kvtier serve signatures v1", hashlib.sha256).digest()


def _signed_bytes(purpose: bytes, node: str, keys: Sequence[bytes]) -> bytes:
    """The canonical encoding of what is signed: each part length-prefixed, so no two
    different (purpose, node, keys) encode alike."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in (purpose, node.encode(), *map(bytes, keys)))


def sign(key: bytes, purpose: bytes, node: str, keys: Sequence[bytes] = ()) -> str:
    """HMAC-SHA256 (hex) of `node` and `keys` for `purpose` (HANDOFF or PUSH_TARGET)."""
    return hmac.new(key, _signed_bytes(purpose, node, keys), hashlib.sha256).hexdigest()


def cluster_id(key: bytes) -> str:
    """A short name of the secret `key` derives from, for /kvtier/load: workers that answer the
    same id sign and check with the same key, so a router can tell a worker whose --secret-file
    differs (every hand-over it signs would be refused) before it routes through it. An HMAC of
    a fixed tag under a purpose of its own: it reveals nothing of the key, and is no signature
    of a hand-over or a push target."""
    return sign(key, CLUSTER_ID, "")[:16]


def signed(key: bytes | None, purpose: bytes, node: str, keys: Sequence[bytes], signature: Any) -> bool:
    """Whether `signature` is sign(key, purpose, node, keys); never with no key."""
    if key is None or not isinstance(signature, str):
        return False
    return hmac.compare_digest(signature.lower().encode(), sign(key, purpose, node, keys).encode())


def reachable_node(node: str, host: str | None) -> str:
    """A node listening on a wildcard address, as reached at `host` (the local address a
    request came in on, so never a client's say); any other node as it is."""
    node_host, _, port = node.rpartition(":")
    if node_host not in WILDCARDS or not host:
        return node
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
