"""Settings of a prefill or decode worker's kvtier node: where it listens and its secret.

A P/D pair on one host needs no link options: the node listens on the HTTP port + 1000
(so workers on ports 8000, 8001, ... get nodes on 9000, 9001, ...; --port 0 gets a free
node port), and without --secret-file or $KVTIER_SECRET a built-in development secret is
used, with a loud warning: it authenticates nothing, since everyone knows it.
"""
from __future__ import annotations

import socket
import sys

from kvtier.errors import ConfigError

NODE_PORT_OFFSET = 1000
DEV_SECRET = b"kvtier-development-secret-INSECURE"


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
