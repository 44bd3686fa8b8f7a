"""The connector's configuration: vLLM's `kv_connector_extra_config` and/or a kvtier config file.

Every key is optional; unknown keys are a ConfigError (a typo must not silently mean
"default"). The tier and store keys are kvtier.StoreConfig's fields, with its defaults
(docs/config.md); the others are the connector's own. A `config_file` (JSON, or TOML on
Python 3.11+) holds the same keys; keys given inline override the file's.

    {"host_capacity": "8GiB",                       # the host-memory tier (always present)
     "disk_path": "/nvme/kvtier", "disk_capacity": "200GiB",   # optional disk tier
     "peers": ["10.0.0.2:7700"] | "directory": "redis://10.0.0.9:6379",   # optional remote tier
     "secret_file": "/etc/kvtier/secret",           # cluster secret (or KVTIER_SECRET)
     "listen": "127.0.0.1:0", "advertise": null,    # where this worker's node serves its store
     "policy": "lru+nopartial", "write_through": false, "hash": "xxh3",   # StoreConfig fields
     "model": null, "revision": null, "salt": "",  # namespace overrides
     "pin_ttl": 600, "max_pending_save": "1GiB", "failure_policy": "recompute",
     "save_generated": true}                        # also save blocks filled by generated tokens

Or an explicit tier list: "tiers": [{"kind": "host", "capacity": "8GiB"},
{"kind": "disk", "path": "/nvme/kvtier", "capacity": "200GiB", "direct": null}].
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig, check_names, no_host_tier, read_settings
from kvtier.errors import ConfigError
from kvtier.keys import checkpoint_revision
from kvtier.net.address import parse_address
from kvtier.net.transport import check_transport
from kvtier.units import parse_bytes

_DEFAULTS = StoreConfig()      # the one set of defaults (docs/config.md)
_KEYS = {
    "config_file", "tiers", "host_capacity", "disk_path", "disk_capacity", "disk_direct", "disk_io_threads",
    "peers", "directory", "lease_s", "remote_timeout", "secret", "secret_file", "listen", "advertise",
    "transport", "policy", "write_through", "promote", "hash", "pin_budget", "io_threads", "model",
    "revision", "salt", "pin_ttl", "session_param", "max_pending_save", "failure_policy", "min_hit_blocks",
    "save_generated",
}


@dataclass
class TierSpec:
    """One tier: kind "host", "disk" or "remote", and its arguments."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConnectorConfig:
    """What the connector was asked for, checked: `store` builds the store, `build_remote()` its peers."""

    tiers_spec: list[TierSpec]
    store: StoreConfig                   # the tiers and the store's behaviour: kvtier.StoreConfig's defaults
    secret: bytes | None = None          # None: a random per-process secret (scheduler <-> own workers only)
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    transport: str = "tcp"
    model: str | None = None
    revision: str | None = None
    salt: bytes = b""
    session_param: str = "x-session-affinity"
    max_pending_save: int = 1 << 30
    failure_policy: str = "recompute"    # "recompute": vLLM recomputes blocks that failed to load; "keep": vLLM's own setting
    min_hit_blocks: int = 1              # shorter external hits are not worth a load
    save_generated: bool = True          # blocks filled by generated tokens too (an agent's next turn starts with them)

    @property
    def remote(self) -> TierSpec | None:
        return next((t for t in self.tiers_spec if t.kind == "remote"), None)

    def build_remote(self, rank: int = 0) -> Any:
        """The store's `remote=` (a kvtier.Remote over the peers or the directory), or None.
        Tensor-parallel rank r fetches from rank r of each peer instance: peers are listed by
        their rank-0 address, and rank r of an instance listens r ports above it (as `listen`)."""
        spec = self.remote
        if spec is None:
            return None
        from kvtier.net import PeerList, RedisDirectory
        from kvtier.net.remote import Remote

        assert self.secret is not None
        a = dict(spec.args)
        directory = a.pop("directory", None)
        peers = [rank_address(p, rank) for p in a.pop("peers", None) or ()]
        lease = a.pop("lease_s", 10.0)
        # The directory's calls get the remote's deadline too: the scheduler allows a lookup
        # that much (its FIND at the worker's node) before it counts a miss.
        d = RedisDirectory(directory, lease_s=lease, timeout=a.get("timeout", 0.5)) if directory else PeerList(peers)
        return Remote(directory=d, secret=self.secret, transport=self.transport, **a)


def rank_address(address: str, rank: int) -> str:
    """A peer's rank-0 address -> its rank-`rank` node's address."""
    if not rank:
        return address
    host, port = parse_address(address)
    return f"[{host}]:{port + rank}" if ":" in host else f"{host}:{port + rank}"


def model_revision(model: str, revision: str | None) -> str:
    """The namespace revision: vLLM's `revision` if given; for a local checkpoint folder,
    kvtier.keys.checkpoint_revision (a checkpoint rewritten in place must not reuse the old
    one's KV); else "" (pin one with the `revision` setting)."""
    if revision:
        return revision
    return checkpoint_revision(model) if Path(model).is_dir() else ""


def _load_file(path: Any) -> dict[str, Any]:
    """The settings of `config_file` (a path string; null: none), its unknown keys named with the file."""
    if path is None:
        return {}
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ConfigError(f"kv_connector_extra_config['config_file'] must be the path of a JSON or TOML file "
                          f"(a non-empty string), got {path!r}; leave the key out for no config file")
    path = os.fspath(path)
    data = read_settings(path)
    data = data.get("vllm", data) if isinstance(data.get("vllm"), dict) else data
    if "config_file" in data:
        raise ConfigError(f"{path}: a config file cannot name another config_file")
    _known(data, f"config file {path}")
    return data


def _known(settings: dict[str, Any], where: str) -> None:
    """A ConfigError naming `where` for settings the connector does not know."""
    unknown = sorted(set(settings) - _KEYS)
    if unknown:
        raise ConfigError(f"unknown kvtier connector setting(s) {unknown} in {where}; "
                          f"known: {', '.join(sorted(_KEYS))}")


def _secret(cfg: dict[str, Any]) -> bytes | None:
    if cfg.get("secret_file"):
        try:
            s = Path(cfg["secret_file"]).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"cannot read secret_file {cfg['secret_file']}: {e.strerror}") from None
    elif cfg.get("secret"):
        s = str(cfg["secret"]).encode()
    else:
        s = os.environ.get("KVTIER_SECRET", "").encode()
    if not s:
        return None
    if len(s) < 16:
        raise ConfigError("the kvtier cluster secret must be at least 16 bytes (secret_file, secret or KVTIER_SECRET)")
    return s


def _size(value: Any, what: str) -> int:
    """A size setting in bytes; its error names the setting."""
    try:
        return parse_bytes(value)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None


def _text(cfg: dict[str, Any], key: str, default: str | None) -> str | None:
    """A string setting (None: not given and no default); not empty, not a number or a list."""
    v = cfg.get(key, default)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a non-empty string, got {v!r}")
    return v


def _num(cfg: dict[str, Any], key: str, default: float, lo: float = 0.0) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number >= {lo}, got {v!r}")
    return v


def _tier_list(cfg: dict[str, Any]) -> list[TierSpec]:
    if "tiers" in cfg:
        flat = {"host_capacity", "disk_path", "disk_capacity", "disk_direct", "peers", "directory"} & cfg.keys()
        if flat:
            raise ConfigError(f"give either 'tiers' or the shorthand keys {sorted(flat)}, not both")
        raw = cfg["tiers"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError("'tiers' must be a non-empty list like [{'kind': 'host', 'capacity': '8GiB'}]")
        specs = []
        for t in raw:
            if not isinstance(t, dict) or t.get("kind") not in ("host", "disk", "remote"):
                raise ConfigError(f"each tier needs kind 'host', 'disk' or 'remote', got {t!r}")
            args = {k: v for k, v in t.items() if k != "kind"}
            specs.append(TierSpec(t["kind"], args))
    else:
        specs = [TierSpec("host", {"capacity": cfg.get("host_capacity", _DEFAULTS.host_capacity)})]
        if "disk_path" in cfg:
            _text(cfg, "disk_path", None)        # a number made ./123, "" meant no disk tier: refused
        if cfg.get("disk_path"):
            d: dict[str, Any] = {"path": cfg["disk_path"], "capacity": cfg.get("disk_capacity", _DEFAULTS.disk_capacity)}
            if "disk_direct" in cfg:
                d["direct"] = cfg["disk_direct"]
            if "disk_io_threads" in cfg:
                d["io_threads"] = cfg["disk_io_threads"]
            specs.append(TierSpec("disk", d))
        else:
            for key in ("disk_capacity", "disk_direct", "disk_io_threads"):
                if key in cfg:
                    raise ConfigError(f"{key} needs disk_path (the directory of the disk tier)")
        if cfg.get("peers") or cfg.get("directory"):
            r: dict[str, Any] = {"timeout": _num(cfg, "remote_timeout", 0.5)}
            if cfg.get("directory"):
                r["directory"] = cfg["directory"]
                r["lease_s"] = _num(cfg, "lease_s", 10.0)
            else:
                peers = cfg["peers"]
                if not isinstance(peers, list) or not all(isinstance(x, str) for x in peers):
                    raise ConfigError(f"kv_connector_extra_config['peers'] must be a list of 'HOST:PORT' strings, "
                                      f"e.g. ['10.0.0.2:7700'], got {peers!r}")
                r["peers"] = list(peers)
            specs.append(TierSpec("remote", r))
    kinds = [t.kind for t in specs]
    if kinds[0] != "host" or kinds.count("host") != 1:
        raise ConfigError(f"the first tier must be the one host tier (vLLM's pages live elsewhere), got {kinds}")
    if "remote" in kinds and kinds[-1] != "remote":
        raise ConfigError(f"the remote tier must come last, got {kinds}")
    for t in specs:
        if t.kind in ("host", "disk"):
            if "capacity" not in t.args and "blocks" not in t.args:
                raise ConfigError(f"the {t.kind} tier needs a capacity, e.g. '8GiB'")
            if "capacity" in t.args and not (t.kind == "disk" and t.args["capacity"] is None):
                c = t.args["capacity"]      # (a disk's None: its folder's present size, 16GiB if new)
                if t.kind == "host" and no_host_tier(c):
                    raise ConfigError(f"the host tier's capacity is {c!r}: the connector always has a host "
                                      "tier (vLLM's pages are saved through it); give a size like '8GiB'")
                _size(c, f"the {t.kind} tier's capacity")   # fail now, not in the worker
        if t.kind == "disk" and not t.args.get("path"):
            raise ConfigError("the disk tier needs a path (a directory; one vLLM instance at a time)")
    return specs


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Check `kv_connector_extra_config` (and the config_file it names) into a ConnectorConfig."""
    extra = dict(extra or {})
    _known(extra, "kv_connector_extra_config")
    cfg: dict[str, Any] = _load_file(extra["config_file"]) if "config_file" in extra else {}
    if not cfg:
        return _parse(extra)
    cfg.update({k: v for k, v in extra.items() if k != "config_file"})
    try:
        return _parse(cfg)
    except ConfigError as e:      # the bad setting may be the file's (messages name kv_connector_extra_config)
        raise ConfigError(f"{e} (settings from config file {extra['config_file']}, "
                          "with kv_connector_extra_config's keys over them)") from None


def _parse(cfg: dict[str, Any]) -> ConnectorConfig:
    cfg = {k: v for k, v in cfg.items() if k != "config_file"}
    specs = _tier_list(cfg)
    secret = _secret(cfg)
    if any(t.kind == "remote" for t in specs) and secret is None:
        raise ConfigError("a remote tier (peers or directory) needs the cluster's shared secret: "
                          "secret_file, secret, or the KVTIER_SECRET environment variable (16+ bytes)")
    failure = cfg.get("failure_policy", "recompute")
    if failure not in ("recompute", "keep"):
        raise ConfigError(f"failure_policy must be 'recompute' or 'keep', got {failure!r}")
    salt = cfg.get("salt", b"")
    if not isinstance(salt, (str, bytes)):
        raise ConfigError(f"kv_connector_extra_config['salt'] must be a string (the tenant's salt), got {salt!r}")
    min_hit = _num(cfg, "min_hit_blocks", 1, 1)
    if min_hit != int(min_hit):
        raise ConfigError(f"kv_connector_extra_config['min_hit_blocks'] must be a whole number >= 1, got {min_hit!r}")
    pending = _size(cfg.get("max_pending_save", "1GiB"), "kv_connector_extra_config['max_pending_save']")
    if pending <= 0:
        raise ConfigError("kv_connector_extra_config['max_pending_save'] must be more than 0 bytes (0 would drop "
                          "every save); give a size like '1GiB'")
    save_generated = cfg.get("save_generated", True)
    if not isinstance(save_generated, bool):
        raise ConfigError(f"kv_connector_extra_config['save_generated'] must be true or false, got {save_generated!r}")
    listen, advertise = _text(cfg, "listen", "127.0.0.1:0"), _text(cfg, "advertise", None)
    for key, addr in (("listen", listen), ("advertise", advertise)):
        if addr is not None:
            try:
                parse_address(addr)
            except ConfigError as e:
                raise ConfigError(f"kv_connector_extra_config[{key!r}]: {e}") from None
    transport = check_transport(_text(cfg, "transport", "tcp"))
    store = _store_config(cfg, specs)        # an unknown policy fails here, not in vLLM's worker
    return ConnectorConfig(
        tiers_spec=specs, store=store, secret=secret, listen=listen,
        advertise=advertise, transport=transport,
        model=_text(cfg, "model", None), revision=_text(cfg, "revision", None),
        salt=salt.encode() if isinstance(salt, str) else bytes(salt),
        session_param=_text(cfg, "session_param", "x-session-affinity"),
        max_pending_save=pending, failure_policy=failure, min_hit_blocks=int(min_hit), save_generated=save_generated)


def _store_config(cfg: dict[str, Any], specs: list[TierSpec]) -> StoreConfig:
    """The StoreConfig of these settings: the tiers (shorthand keys or the 'tiers' list) and the
    store's keys; what is not given keeps StoreConfig's default."""
    host = next(t for t in specs if t.kind == "host").args
    disks = [t.args for t in specs if t.kind == "disk"]
    remotes = [t.args for t in specs if t.kind == "remote"]
    for args, known in ([(host, ["capacity"])] + [(d, ["path", "capacity", "direct", "io_threads"]) for d in disks]
                        + [(r, ["peers", "directory", "timeout", "lease_s", "promote"]) for r in remotes]):
        check_names(args, known, "'tiers' list")     # a remote's stray key was a TypeError in the worker
    for r in remotes:
        for key in ("timeout", "lease_s"):
            v = r.get(key, 1.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"the remote tier's {key} must be a number of seconds > 0, got {v!r}")
    if len(disks) > 1:
        raise ConfigError("give at most one disk tier (one directory per vLLM instance)")
    if "capacity" not in host or any("capacity" not in d for d in disks):
        raise ConfigError("give each tier a capacity, e.g. {'kind': 'host', 'capacity': '8GiB'}")
    fields: dict[str, Any] = {"host_capacity": host["capacity"]}
    if disks:
        d = disks[0]
        fields.update(disk_path=str(d["path"]), disk_capacity=d["capacity"])
        if d.get("direct") is not None:
            fields["disk_direct"] = d["direct"]
        if "io_threads" in d:
            fields["disk_io_threads"] = d["io_threads"]
    for key in ("policy", "hash", "pin_budget", "pin_ttl", "write_through", "promote", "io_threads"):
        if key in cfg:
            fields[key] = cfg[key]
    return StoreConfig.from_dict(fields, where="kvtier connector settings")
