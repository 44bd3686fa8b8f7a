"""Optional TLS for the TCP transport: payloads encrypted on the wire, the node's identity checked.

`Tls(cert=..., key=...)` on a node (it serves TLS only); `Tls(ca=...)` on the calling side
(Remote, PeerClient), which verifies the node's certificate against that CA file and the
address it dials (the certificate needs that IP or host name among its subject names).
The cluster secret still authenticates every frame inside TLS. Every bad path or file is a
ConfigError that says which file and what to do.
"""
from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
from dataclasses import dataclass

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class Tls:
    """Certificate files: `cert` and `key` (PEM) to serve, `ca` (PEM) to verify a node."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def server_context(self) -> ssl.SSLContext:
        """The node's context; ConfigError unless cert and key load."""
        if not self.cert or not self.key:
            raise ConfigError("a TLS node needs a certificate and its key: Tls(cert=FILE, key=FILE) "
                              "(--tls-cert and --tls-key)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _readable(self.cert, "TLS certificate")
        _readable(self.key, "TLS key")
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"cannot load the TLS certificate {self.cert} with key {self.key}: {_ssl_why(e)} "
                              "(both must be PEM, and the key must match the certificate)") from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The calling side's context; ConfigError unless the CA file loads."""
        if not self.ca:
            raise ConfigError("a TLS client needs the CA file that signed the nodes' certificates: "
                              "Tls(ca=FILE) (--tls-ca)")
        _readable(self.ca, "TLS CA file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)     # verifies the certificate and host name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_verify_locations(self.ca)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"cannot load the TLS CA file {self.ca}: {_ssl_why(e)} (it must be PEM)") from None
        return ctx


def check_tls(tls: object) -> Tls | None:
    if tls is not None and not isinstance(tls, Tls):
        raise ConfigError(f"tls must be a kvtier.net.Tls(cert=..., key=..., ca=...), not {type(tls).__name__}")
    return tls


def _readable(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"the {what} {path} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"the {what} {path} is not readable by this user")


def _ssl_why(e: BaseException) -> str:
    """OpenSSL's reason, without its source location."""
    text = str(getattr(e, "reason", None) or getattr(e, "strerror", None) or e)
    return re.sub(r"\s*\(_ssl\.c:\d+\)", "", text).replace("[SSL] ", "")


def throwaway_cert(directory: str, host: str = "127.0.0.1") -> Tls:
    """A self-signed certificate for `host` (an IP address) in `directory`, valid for a day,
    for tests and benchmarks: Tls(cert, key, ca=cert). Needs the `openssl` command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("making a throwaway TLS certificate needs the openssl command (apt install openssl)")
    cert, key = os.path.join(directory, "node.pem"), os.path.join(directory, "node.key")
    r = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=kvtier-throwaway",
                        "-addext", f"subjectAltName=IP:{host}"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise ConfigError(f"openssl could not make a throwaway certificate: {r.stderr.strip()[-300:]}")
    return Tls(cert=cert, key=key, ca=cert)
