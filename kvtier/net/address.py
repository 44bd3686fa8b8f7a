"""Peer addresses: "host:port" strings, checked once at the boundary.

IPv6 addresses go in brackets, `[::1]:7700` (the form `node.address` prints); the host
returned has no brackets, as bind and connect take it. Without brackets a valid IPv6 host
before the last colon is read too (`::1:7700`, as code that joins host and port makes it).
Port 0 means "any free port" and is valid only where a node listens, never for an address
others dial.
"""
from __future__ import annotations

import ipaddress

from kvtier.errors import ConfigError

EXAMPLE = "127.0.0.1:7700 (IPv6 in brackets: [::1]:7700)"


def parse_address(text: str, *, any_port: bool = True) -> tuple[str, int]:
    """"host:port" or "[v6]:port" -> (host, port), with a clear error. `any_port=False`
    (a peer's or an advertised address) refuses port 0."""
    if not isinstance(text, str):
        raise ConfigError(f"address must be a 'host:port' string, not {type(text).__name__}")
    host, port = _split(text)
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"address {text!r} must look like {EXAMPLE}: the port is a number below 65536")
    if int(port) == 0 and not any_port:
        raise ConfigError(f"address {text!r} names port 0, which only a listening node may use (any free "
                          "port): give the port the node listens on, e.g. 10.0.0.2:7700")
    return host, int(port)


def listen_infos(host: str, port: int) -> list:
    """socket.getaddrinfo of (host, port) for a listening socket; a ValueError saying why
    where the host resolves to nothing (a failed lookup, or a name that is none, e.g. `a..b`,
    which the lookup refuses with a UnicodeError rather than a gaierror)."""
    import socket
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(e.strerror) from None
    except UnicodeError:
        raise ValueError("not a valid host name") from None


def _split(text: str) -> tuple[str, str]:
    """(host without brackets, port text) of `text`; ConfigError for a malformed host."""
    if text.startswith("["):
        inside, sep, port = text[1:].partition("]:")
        if not sep or not _is_ipv6(inside):
            raise ConfigError(f"address {text!r} must look like [::1]:7700: an IPv6 address in brackets, "
                              "then :PORT")
        return inside, port
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"address {text!r} must look like {EXAMPLE}")
    if ":" in host and not _is_ipv6(host):
        raise ConfigError(f"address {text!r} must look like {EXAMPLE}: write an IPv6 address in brackets")
    if any(c.isspace() or c in ",[]" for c in host):
        raise ConfigError(f"address {text!r}: the host {host!r} is not a host name or IP address; "
                          f"give one, e.g. {EXAMPLE}")
    return host, port


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def format_address(host: str, port: int) -> str:
    """(host, port) as "host:port", an IPv6 host in brackets (parse_address reads it back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_unspecified(host: str) -> bool:
    """Whether `host` is 0.0.0.0 or :: (every interface): no address another machine can dial."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
