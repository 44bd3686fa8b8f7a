"""`kvtier node`: run a store that serves its blocks to peers (and fetches theirs)."""
from __future__ import annotations

import argparse

HELP = "serve a store's blocks to peers over TCP (and fetch from peers with --peers)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:7700", help="host:port to serve on (port 0: any free port)")
    p.add_argument("--layout", default="kimi-k2", help="layout preset (default kimi-k2)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--model", default=None, help="namespace model id (default: the layout preset's name)")
    p.add_argument("--revision", default="", help="namespace revision")
    p.add_argument("--shard", default="", help="namespace shard, e.g. tp0/8")
    p.add_argument("--capacity", default="8GiB", help="host tier capacity (default 8GiB)")
    p.add_argument("--disk", default=None, help="directory of a disk tier (optional)")
    p.add_argument("--disk-capacity", default="100GiB", help="disk tier capacity (default 100GiB)")
    p.add_argument("--peers", default="", help="comma-separated host:port of other nodes to fetch from")
    p.add_argument("--directory", default=None,
                   help="redis://host:port of a Redis directory: publish what this node holds, find other nodes' blocks")
    p.add_argument("--advertise", default=None, help="host:port peers should use to reach this node (default: --listen)")
    p.add_argument("--lease", type=float, default=10.0, help="seconds a node stays listed after it stops renewing")
    p.add_argument("--transport", default="tcp", choices=["tcp", "ucx"],
                   help="tcp (default) or ucx (needs kvtier[ucx]); for serving and for fetching")
    p.add_argument("--secret-file", default=None,
                   help="file holding the cluster's shared secret (or set KVTIER_SECRET); at least 16 bytes")
    p.add_argument("--policy", default="recommended", help="eviction policy (default: the recommended one)")


def read_secret(path: str | None) -> bytes:
    """The cluster secret from a file or the KVTIER_SECRET variable."""
    import os

    from kvtier.errors import ConfigError

    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the secret file {path}: {e.strerror}") from None
    else:
        secret = os.environ.get("KVTIER_SECRET", "").encode()
    if len(secret) < 16:
        raise ConfigError("a node needs the cluster's shared secret, at least 16 bytes: "
                          "--secret-file FILE or KVTIER_SECRET=...")
    return secret


def run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.layout import preset_layout
    from kvtier.net import Node
    from kvtier.store import Store
    from kvtier.tiers import DiskTier, HostTier
    from kvtier.tiers.remote import RemoteTier

    secret = read_secret(args.secret_file)
    layout = preset_layout(args.layout, args.block_tokens)
    tiers: list = [HostTier(capacity=args.capacity)]
    if args.disk:
        tiers.append(DiskTier(args.disk, capacity=args.disk_capacity))
    peers = [p for p in args.peers.split(",") if p]
    directory = None
    if args.directory and peers:
        raise ConfigError("give --peers or --directory, not both")
    if args.directory:
        from kvtier.net import RedisDirectory
        directory = RedisDirectory(args.directory, lease_s=args.lease)
        tiers.append(RemoteTier(directory=directory, secret=secret, transport=args.transport))
    elif peers:
        tiers.append(RemoteTier(peers, secret, transport=args.transport))
    ns = Namespace(args.model or args.layout, args.revision, args.shard)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Store(layout, tiers, ns, policy=args.policy) as store, \
            Node(store, args.listen, secret, directory=directory, advertise=args.advertise,
                 transport=args.transport) as node:
        print(f"kvtier node: serving {ns.model!r} ({layout.describe()}) on {node.address}", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
        st = store.stats()
        print(f"kvtier node: stopping; served {node.served} requests, refused {node.refused}, "
              f"{st.tiers[0].used_blocks} blocks in host memory", flush=True)
    return 0
