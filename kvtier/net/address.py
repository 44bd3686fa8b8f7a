"""Peer addresses: "host:port" strings, checked once at the boundary."""
from __future__ import annotations

from kvtier.errors import ConfigError


def parse_address(text: str) -> tuple[str, int]:
    """"host:port" -> (host, port), with a clear error."""
    if not isinstance(text, str):
        raise ConfigError(f"address must be a 'host:port' string, not {type(text).__name__}")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {text!r} must look like 127.0.0.1:7700")
    return host, int(port)
