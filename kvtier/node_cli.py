"""`kvtier node`: run a store that serves its blocks to peers (and fetches theirs).

Every option is checked before any memory is taken, so a typo is a one-line error at
once. Peers and Redis may come up in any order: one that does not answer at start is
reported on one line and retried with backoff (kvtier/net/health.py), and its coming
back is reported too. Ctrl-C, SIGTERM or SIGHUP (its terminal closed) stops the node
cleanly: it stops serving, leaves the directory, and closes the store (writing host blocks
down to a disk tier).
--salt-file makes the node serve one tenant's namespace; --tls-cert/--tls-key serve TLS and
--tls-ca fetches from TLS peers (docs/cluster.md, Security).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable

from kvtier.argtypes import non_negative_float, positive_float, positive_int, size
from kvtier.errors import ConfigError, KvtierError
from kvtier.progress import progress, say, wanted

if TYPE_CHECKING:
    from kvtier.store import Store

HELP = "serve a store's blocks to peers over TCP (and fetch from peers with --peers or --directory)"
PROBE_EVERY_S = 0.5     # how often a node looks for peers that were down and are due for a retry
# How often a node with a disk tier flushes: a node killed with SIGKILL kept only what host
# evictions had written down (a helper's run: 0 of 300 acknowledged requests whole after a
# restart: their shared roots were all only in host memory). A flush of what arrived in a
# minute moves that minute's puts at most, off the serving threads' path but under the
# store's lock in short steps.
FLUSH_EVERY_S = 60.0
MAX_KEY_FILE_BYTES = 64 << 10   # the most read of a --secret-file or --salt-file (a wrong path: /dev/zero)


def _checked(check: Callable[[str], object], name: str) -> Callable[[str], object]:
    """An argparse type from a library check that raises ConfigError."""
    def parse(text: str) -> object:
        try:
            return check(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = name
    return parse


def _address(text: str) -> str:
    """An address to listen on (port 0: any free port)."""
    from kvtier.net.address import parse_address
    parse_address(text)
    return text


def _dialled(text: str) -> str:
    """An address other nodes dial (--advertise): port 0 is refused."""
    from kvtier.net.address import parse_address
    parse_address(text, any_port=False)
    return text


def _peers(text: str) -> list[str]:
    """Comma-separated host:port addresses (duplicates dropped; an empty item is an error,
    not silently no peer)."""
    from kvtier.net.address import parse_address
    peers: list[str] = []
    for p in (x.strip() for x in text.split(",")):
        if not p:
            raise ConfigError(f"{text!r} has an empty entry: list peers as HOST:PORT separated by commas, "
                              "e.g. 10.0.0.2:7700,10.0.0.3:7700")
        try:
            parse_address(p, any_port=False)
        except ConfigError as e:
            raise ConfigError(f"peer {e} (separate several with commas)") from None
        if p not in peers:
            peers.append(p)
    return peers


def _redis_url(text: str) -> str:
    from kvtier.net.directory import check_redis_url
    check_redis_url(text)
    return text


def _shard(text: str) -> str:
    from kvtier.shard import check_shard
    return check_shard(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.config import StoreConfig
    from kvtier.presets import LAYOUT_PRESETS as PRESETS

    p.add_argument("--listen", default="127.0.0.1:7700", metavar="HOST:PORT", type=_checked(_address, "address"),
                   help="where to serve; port 0 picks any free port")
    p.add_argument("--layout", default="kimi-k2", metavar="NAME", choices=list(PRESETS),
                   help=f"KV layout preset: {', '.join(PRESETS)}")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a kvtier store config (JSON or TOML, see docs/config.md); the flags below override it "
                        "(default: the defaults of kvtier.StoreConfig)")
    p.add_argument("--block-tokens", type=positive_int, default=None, metavar="N",
                   help=f"tokens per block (default: block_tokens, {StoreConfig.shown_default('block_tokens')})")
    p.add_argument("--model", default=None,
                   help="namespace model id; nodes share blocks only within one namespace "
                        "(default: the --layout preset's name)")
    p.add_argument("--revision", default="", help="namespace revision, e.g. the checkpoint's (default: none)")
    p.add_argument("--shard", default="", type=_checked(_shard, "shard"),
                   help="namespace shard: tpRANK/SIZE (tp0/8 is tensor-parallel rank 0 of 8), ppRANK/SIZE, "
                        "or both as tp0/8,pp1/4 (default: unsharded)")
    p.add_argument("--capacity", default=None, type=size, metavar="SIZE",
                   help=f"host tier capacity (default: host_capacity, {StoreConfig.shown_default('host_capacity')})")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="directory of a disk tier below the host tier (default: disk_path, none)")
    p.add_argument("--disk-capacity", default=None, type=size, metavar="SIZE",
                   help=f"disk tier capacity, preallocated at start; a smaller size shrinks an existing tier "
                        f"(default: disk_capacity, {StoreConfig.shown_default('disk_capacity')})")
    p.add_argument("--flush-every", type=non_negative_float, default=FLUSH_EVERY_S, metavar="SECONDS",
                   help="with a disk tier, write host-only blocks down (and sync) this often, so a node "
                        "killed without a chance to stop (SIGKILL, the OOM killer) keeps all but the last "
                        "SECONDS of puts; 0: only when it stops (default: %(default)g)")
    p.add_argument("--peers", default=[], type=_checked(_peers, "peers"), metavar="HOST:PORT,...",
                   help="other nodes to fetch from, comma-separated; each is asked directly (default: none)")
    p.add_argument("--directory", default=None, metavar="URL", type=_checked(_redis_url, "url"),
                   help="Redis directory (redis://HOST:PORT[/DB], rediss://... for TLS, unix:///PATH): "
                        "publish what this node holds, find other nodes' blocks (default: none)")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT", type=_checked(_dialled, "address"),
                   help="with --directory: the address peers should use to reach this node "
                        "(default: the --listen address)")
    p.add_argument("--lease", type=positive_float, default=None, metavar="SECONDS",
                   help="with --directory: how long this node stays listed after it stops renewing "
                        "(it renews every 50 ms) (default: 10)")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"],
                   help="how blocks travel, for serving and for fetching; ucx needs kvtier[ucx]")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="file holding the cluster's shared secret, at least 16 bytes "
                        "(default: the KVTIER_SECRET variable)")
    p.add_argument("--salt-file", default=None, metavar="FILE",
                   help="file holding the tenant salt (any bytes; surrounding whitespace is ignored): the node "
                        "serves, and fetches, only that tenant's namespace (default: no salt, the default tenant)")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="serve TLS with this PEM certificate (with --tls-key); peers then need --tls-ca "
                        "(default: plain TCP)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="the PEM private key of --tls-cert (default: none)")
    p.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="fetch from peers over TLS, verifying their certificates against this PEM CA file "
                        "(with --peers or --directory; default: plain TCP to peers)")
    p.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="open connections at most (default 1024); past it a new one closes the longest-waiting connection "
                        "that has not authenticated, or is closed itself")
    p.add_argument("--idle-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help="close a peer's connection after this long without a request (default 300; "
                        "kvtier clients reconnect by themselves)")
    p.add_argument("--policy", default=None, metavar="NAME",
                   help=f"eviction policy, e.g. lru or arc+nopartial (default: policy, {StoreConfig.shown_default('policy')})")


def read_secret(path: str | None) -> bytes:
    """The cluster secret from a file or the KVTIER_SECRET variable."""
    import os

    from kvtier.config import read_bounded

    if path:
        secret = read_bounded(path, MAX_KEY_FILE_BYTES, "secret file").strip()
    else:
        secret = os.environ.get("KVTIER_SECRET", "").encode().strip()    # as the file's: a stray space or newline
    if len(secret) < 16:
        where = f"the secret file {path} holds {len(secret)} bytes" if path else \
            ("KVTIER_SECRET holds " + f"{len(secret)} bytes" if secret else "no --secret-file or KVTIER_SECRET given")
        raise ConfigError(f"a node needs the cluster's shared secret, at least 16 bytes ({where}): "
                          "--secret-file FILE or KVTIER_SECRET=...")
    return secret


def read_salt(path: str | None) -> bytes:
    """The tenant salt from a file (b"" without one)."""
    from kvtier.config import read_bounded

    if not path:
        return b""
    salt = read_bounded(path, MAX_KEY_FILE_BYTES, "salt file").strip()
    if not salt:
        raise ConfigError(f"the salt file {path} is empty: put the tenant's salt in it, or leave --salt-file out "
                          "for the default tenant")
    return salt


def tls_options(args: argparse.Namespace) -> tuple[object, object]:
    """(serving Tls or None, fetching Tls or None) from --tls-cert/--tls-key/--tls-ca, each
    file checked now."""
    from kvtier.net.tls import Tls

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together: give both to serve TLS")
    if args.transport != "tcp" and (args.tls_cert or args.tls_ca):
        raise ConfigError("TLS is for --transport tcp; UCX brings its own transports")
    serve = fetch = None
    if args.tls_cert:
        serve = Tls(cert=args.tls_cert, key=args.tls_key)
        serve.server_context()
    if args.tls_ca:
        if not (args.peers or args.directory):
            raise ConfigError("--tls-ca is for fetching from peers over TLS: give --peers or --directory too")
        fetch = Tls(ca=args.tls_ca)
        fetch.client_context()
    return serve, fetch


def disk_size(store: Store) -> str:
    """The disk tier's size as the banner shows it ("" without one): its blocks' bytes, as
    `kvtier inspect`, `store.stats()` and /metrics count them (not its 4 KiB-aligned slots')."""
    from kvtier.units import format_bytes

    for t in store.tiers:
        if t.kind == "disk":
            return " " + format_bytes(t.capacity_blocks * t.block_bytes)
    return ""


def run(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading
    import time

    from kvtier.keys import Namespace
    from kvtier.layout import preset_layout
    from kvtier.net import Node, NodeLimits
    from kvtier.net.address import parse_address
    from kvtier.net.node import check_advertised, check_listen_host
    from kvtier.config import StoreConfig
    from kvtier.engine.generate_cli import check_capacities
    from kvtier.net.remote import Remote
    from kvtier.units import format_bytes, parse_bytes

    # Everything that can be checked is checked before any memory or disk is taken.
    secret = read_secret(args.secret_file)
    salt = read_salt(args.salt_file)
    serve_tls, fetch_tls = tls_options(args)
    config, sources = StoreConfig.from_command(args.config, {
        "block_tokens": ("--block-tokens", args.block_tokens), "host_capacity": ("--capacity", args.capacity),
        "disk_path": ("--disk", args.disk), "disk_capacity": ("--disk-capacity", args.disk_capacity),
        "policy": ("--policy", args.policy)})
    if config.host_capacity is None:
        raise ConfigError("a node serves from a host tier: give host_capacity (--capacity) a size")
    layout = preset_layout(args.layout, config.block_tokens)
    # A tier smaller than one block is named as the user gave it (a flag, a key of the file).
    check_capacities(config, layout.block_bytes, sources, device=False)
    ns = Namespace(args.model or args.layout, args.revision, args.shard, salt=salt)
    if args.directory and args.peers:
        raise ConfigError("give --peers or --directory, not both")
    if args.advertise and not args.directory:
        raise ConfigError("--advertise is for --directory (peers listed with --peers are reached as listed)")
    if args.lease is not None and not args.directory:
        raise ConfigError("--lease is for --directory (how long this node's entry there lives without renewal)")
    check_advertised(parse_address(args.listen)[0], bool(args.directory), args.advertise)
    check_listen_host(args.listen, "--listen")     # before any memory is taken
    args.lease = 10.0 if args.lease is None else args.lease

    directory = remote = None
    where = [f"host {format_bytes(parse_bytes(config.host_capacity))}"]
    if args.directory:
        from kvtier.net import RedisDirectory
        directory = RedisDirectory(args.directory, lease_s=args.lease)
        remote = Remote(directory=directory, secret=secret, transport=args.transport, tls=fetch_tls)
        where.append(f"directory {directory.url}")
    elif args.peers:
        remote = Remote(args.peers, secret, transport=args.transport, tls=fetch_tls)
        where.append(f"peers {','.join(args.peers)}")

    limits = NodeLimits(**{name: v for name in ("max_connections", "idle_timeout")
                           if (v := getattr(args, name)) is not None})
    if salt:
        where.append("tenant salt from " + args.salt_file)
    if serve_tls:
        where.append("TLS")
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            say("kvtier node: already stopping (closing the store); kill -9 aborts and loses what is "
                "not on disk yet")
        stop.set()

    # A spinner while the store opens: a disk tier of 2M blocks took 25-33 s to adopt, silently.
    with progress("opening the store" + (f", adopting the blocks in {config.disk_path}" if config.disk_path else ""),
                  enabled=wanted()):
        store = config.build(layout, ns, remote=remote)
    with store:
        if config.disk_path:        # its size as opened (an existing tier keeps its own)
            where.insert(1, f"disk {config.disk_path}{disk_size(store)}")
        with Node(store, args.listen, secret, directory=directory, advertise=args.advertise,
                  transport=args.transport, tls=serve_tls, limits=limits) as node:
            # From here on, a signal stops the node cleanly. SIGHUP too: a node started from a
            # terminal that closed (an ssh session dropped) died at once, losing every block
            # only in host memory.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, on_signal)
            say(f"kvtier node: serving {ns.model!r} (revision {ns.revision!r}, shard {ns.shard or 'none'}; "
                f"{layout.describe()}; {', '.join(where)}) on {node.address}")
            say("kvtier node: Ctrl-C or SIGTERM stops it")
            if remote is not None:
                remote.probe()                       # logs each peer that does not answer, once
            flush_every = args.flush_every if config.disk_path else 0.0
            flushed = time.monotonic()
            while not stop.wait(PROBE_EVERY_S):
                if remote is not None:
                    remote.probe(only_down=True)     # and logs when it answers again
                if flush_every and time.monotonic() - flushed >= flush_every:
                    try:
                        store.flush()
                    except KvtierError as e:         # a failing disk: said, and tried again later
                        logging.getLogger("kvtier.node").warning("flushing to disk failed: %s", e)
                    flushed = time.monotonic()
            say("kvtier node: stopping" + (" (writing host blocks down to disk)" if config.disk_path else ""))
        st = store.stats()
        served, refused, held = node.served, node.refused, st.tiers[0].used_blocks
    say(f"kvtier node: stopped; served {served} requests, refused {refused}, "
        f"{held} blocks were in host memory")
    return 0
