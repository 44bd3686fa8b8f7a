"""`kvtier vllm-check`: the vLLM connector's configuration, checked before vLLM starts.

vLLM hands the connector its settings only in the worker process, after it has loaded the
model, so a bad setting otherwise surfaces minutes later inside vLLM's traceback ("Engine
core initialization failed"). This command takes the JSON given to `--kv-transfer-config`
(or its `kv_connector_extra_config` alone), checks the fields vLLM needs to find the
connector, runs the connector's own parsing (config.parse_config), then the checks the
worker makes when it starts that need neither vLLM nor the model: the host tier against
the memory available, the disk tier's directory writable with room for its slabs, the
listen port free, the peers' addresses, the Redis directory's URL. Nothing is allocated,
no peer or directory is contacted, vLLM is not imported. Exit 0 with a summary of what
the connector will build; 2 with one `kvtier: error:` line for a setting that cannot work.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.argtypes import positive_int
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.integrations.vllm.config import ConnectorConfig

HELP = "check the vLLM connector's --kv-transfer-config before starting vLLM (vLLM not needed)"

CONNECTOR, MODULE = "KvtierConnector", "kvtier.integrations.vllm"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: vLLM 0.32's KVTransferConfig fields: it refuses any other key of --kv-transfer-config.
VLLM_FIELDS = ["kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config",
               "kv_load_failure_policy", "engine_id", "kv_buffer_device", "kv_port", "enable_permute_local_kv"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG",
                   help="the JSON given to vLLM's --kv-transfer-config (an argument starting with '{'), a file "
                        "holding it, or - to read it from stdin; an object without kv_connector is taken as "
                        "kv_connector_extra_config alone (e.g. '{\"config_file\": \"/etc/kvtier/vllm.json\"}')")
    p.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                   help="vLLM's tensor-parallel size: each rank's worker allocates its own host tier and disk "
                        "folder and listens one port further")


def read_json(config: str) -> dict[str, Any]:
    """The object given as `config`: JSON text (starting with '{'), '-' (stdin) or a file's path."""
    from kvtier.config import MAX_CONFIG_BYTES, parse_json, read_bounded

    if config.lstrip().startswith("{"):
        text, where = config, "the argument"
    elif config == "-":
        text, where = sys.stdin.read(MAX_CONFIG_BYTES + 1), "the JSON on stdin"
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"the JSON on stdin is larger than {MAX_CONFIG_BYTES:,} characters: give the "
                              "--kv-transfer-config object")
    elif Path(config).exists():
        try:
            text, where = read_bounded(config, MAX_CONFIG_BYTES, "file").decode(), config
        except UnicodeDecodeError:
            raise ConfigError(f"{config} is not text: give a file holding the --kv-transfer-config JSON") from None
    else:
        raise ConfigError(f"{config!r} is neither a JSON object (it does not start with '{{') nor a file: give the "
                          "JSON you pass to --kv-transfer-config (in single quotes), a file holding it, or - for stdin")
    data = parse_json(text, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, e.g. {{\"kv_connector\": \"{CONNECTOR}\", ...}}")
    return data


def check_vllm_fields(tc: dict[str, Any]) -> dict[str, Any]:
    """What vLLM needs of --kv-transfer-config to load the connector, checked; returns
    kv_connector_extra_config."""
    from kvtier.config import check_names

    check_names(tc, VLLM_FIELDS, "--kv-transfer-config (vLLM 0.32's KVTransferConfig)")
    name = tc.get("kv_connector")
    if name != CONNECTOR:
        got = "has no kv_connector" if name is None else f"names kv_connector {name!r}"
        raise ConfigError(f"--kv-transfer-config {got}: kvtier's is \"kv_connector\": \"{CONNECTOR}\"")
    module = tc.get("kv_connector_module_path")
    if module != MODULE:
        got = "is missing" if module is None else f"is {module!r}"
        raise ConfigError(f"kv_connector_module_path {got}: vLLM finds {CONNECTOR} only through "
                          f"\"kv_connector_module_path\": \"{MODULE}\"")
    role = tc.get("kv_role")
    if role not in ROLES:
        got = "is missing (vLLM refuses a kv_connector without one)" if role is None else f"{role!r} is not a role"
        raise ConfigError(f"kv_role {got}: give one of {', '.join(ROLES)} (\"kv_both\": load and save)")
    policy = tc.get("kv_load_failure_policy", "fail")
    if policy not in ("recompute", "fail"):
        raise ConfigError(f"kv_load_failure_policy must be \"recompute\" or \"fail\", got {policy!r}")
    extra = tc.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config must be a JSON object of kvtier's settings, e.g. "
                          f"{{\"host_capacity\": \"8GiB\"}}, got {extra!r}")
    return extra


def check_start(cfg: ConnectorConfig, tp: int) -> list[str]:
    """The checks each worker makes when it starts that need no model: its host tier's memory,
    its disk folder, its listen port, its peers. Returns the summary's lines."""
    from kvtier.tiers.memory import memory_available, too_large
    from kvtier.units import format_bytes, parse_bytes

    per = f" x {tp} ranks" if tp > 1 else ""
    host = parse_bytes(cfg.store.host_capacity)
    err = too_large(f"host_capacity {format_bytes(host)}{per}", host * tp)
    if err is not None:
        raise err
    avail = memory_available()[0]
    lines = [f"tiers, per worker ({tp} tensor-parallel rank{'s' if tp > 1 else ''}):",
             f"  host    {format_bytes(host)}, allocated at start"
             + (f" ({format_bytes(avail)} of memory available here)" if avail is not None else "")]
    if cfg.store.disk_path is not None:
        lines += _check_disk(cfg, tp)
    lines += _check_remote(cfg, tp)
    lines += _check_listen(cfg, tp)
    return lines


def _check_disk(cfg: ConnectorConfig, tp: int) -> list[str]:
    """disk_path: a directory (or one that can be made) this user can write, with room for each
    rank's folder, allocated in full at start (DiskTier's own check_room)."""
    import os
    import tempfile

    from kvtier.config import DEFAULT_DISK_CAPACITY
    from kvtier.errors import TierSizeError
    from kvtier.tiers.disk_dir import check_room, nearest_existing
    from kvtier.units import format_bytes, parse_bytes

    path = Path(cfg.store.disk_path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"disk_path {path} is a file: give a directory (it is created if missing)")
    given = cfg.store.disk_capacity
    size = parse_bytes(DEFAULT_DISK_CAPACITY if given is None else given)
    shown = format_bytes(size) + ("" if given is not None else " (the default for a new folder)")
    try:
        folders = [p for p in path.iterdir() if (p / "slab.bin").is_file()] if path.is_dir() else []
    except OSError:          # unreadable: the worker's mkdir may still work (tried below)
        folders = []
    line = f"  disk    {shown}, allocated at start in {path}/MODEL-SEED"
    there = f"{len(folders)} folder{'s' if len(folders) != 1 else ''} there already"
    try:                     # first, as DiskTier does: a virtual filesystem (/proc) is named as one
        free = check_room(path, size * tp)
    except TierSizeError as e:
        if not folders:      # every rank's folder is new: its slab cannot be allocated
            per = f" x {tp} ranks" if tp > 1 else ""
            raise TierSizeError(f"disk_capacity {format_bytes(size)}{per}: {e}") from None
        free = None          # the model's folders may be among those there, their slabs allocated already
    where = nearest_existing(path)                            # where the worker's mkdir starts
    try:        # tried, not asked of os.access (which says yes to root where writing still fails)
        os.rmdir(tempfile.mkdtemp(prefix=".kvtier-vllm-check-", dir=where))
    except OSError as e:
        raise ConfigError(f"disk_path {path}: cannot create a folder in {where} ({e.strerror}): give a directory "
                          "this user can write (each worker makes its own folder there)") from None
    if free is None:
        return [f"{line} ({there})", f"  warning: less than {format_bytes(size * tp)} free in {path}: enough "
                                     "only if this model's folders are among those there already"]
    return [f"{line} ({format_bytes(free)} free" + (f"; {there})" if folders else ")")]


def _check_remote(cfg: ConnectorConfig, tp: int) -> list[str]:
    """The remote tier's peers (each rank's address parsed as the worker's PeerList does) or
    its Redis directory's URL; nothing is contacted."""
    import importlib.util

    from kvtier.integrations.vllm.config import rank_address
    from kvtier.net.directory import PeerList, check_redis_url

    spec = cfg.remote
    if spec is None:
        return []
    timeout = f"answers within {spec.args.get('timeout', 0.5)} s"
    if spec.args.get("directory"):
        url = check_redis_url(spec.args["directory"])
        if importlib.util.find_spec("redis") is None:
            raise ConfigError("the Redis directory needs the redis package: pip install 'kvtier[cluster]'")
        return [f"  remote  Redis directory {url} ({timeout}, lease {spec.args.get('lease_s', 10.0)} s)"]
    peers = spec.args.get("peers") or []
    try:
        for rank in range(tp):
            PeerList([rank_address(p, rank) for p in peers]).close()
    except ConfigError as e:
        raise ConfigError(f"peers: {e}") from None
    return [f"  remote  peers {', '.join(peers)} ({timeout})"]


def _check_listen(cfg: ConnectorConfig, tp: int) -> list[str]:
    """Where each rank's node listens: a host of this machine and, for a fixed port, the ports
    free now (Node.start's checks and its message)."""
    import socket

    from kvtier.net.address import parse_address
    from kvtier.net.node import check_advertised, check_listen_host, listen_failure

    host, port = parse_address(cfg.listen)
    check_listen_host(cfg.listen, "listen")
    remote = cfg.remote
    check_advertised(host, remote is not None and bool(remote.args.get("directory")), cfg.advertise)
    for rank in range(tp if port else 0):
        addr = f"[{host}]:{port + rank}" if ":" in host else f"{host}:{port + rank}"
        if port + rank > 65535:
            raise ConfigError(f"listen {cfg.listen}: rank {rank} would listen on port {port + rank}, past 65535: "
                              "give a lower port")
        try:
            socket.create_server((host, port + rank), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
        except OSError as e:
            raise ConfigError(f"listen {cfg.listen}: cannot listen on {addr}"
                              f"{f' (rank {rank})' if tp > 1 else ''}: {listen_failure(e)}") from None
    where = (f"{cfg.listen}, rank r on port {port} + r" if tp > 1 else cfg.listen) if port else \
        f"{cfg.listen} (any free port)"
    secret = ("set (peers may fetch from this instance)" if cfg.secret is not None else
              "none (a random one per worker: only this instance's scheduler asks its node)")
    return [f"node: listens on {where}" + (f", advertised as {cfg.advertise}" if cfg.advertise else "")
            + f", transport {cfg.transport}; cluster secret: {secret}"]


def summary(tc: dict[str, Any] | None, cfg: ConnectorConfig, start: list[str]) -> list[str]:
    """What the connector will build, in a few lines."""
    s = cfg.store
    if tc is None:
        head = "kv_connector_extra_config only: kv_connector, kv_connector_module_path and kv_role not checked"
    else:
        head = f"{CONNECTOR} from {MODULE}, kv_role {tc['kv_role']}"
    model = f"{cfg.model!r}" if cfg.model else "vLLM's"
    revision = f"{cfg.revision!r}" if cfg.revision is not None else "vLLM's (a local checkpoint: a digest of its files)"
    failure = ("recompute (the connector sets vLLM's kv_load_failure_policy to \"recompute\")"
               if cfg.failure_policy == "recompute" else
               f"keep: vLLM's kv_load_failure_policy, {(tc or {}).get('kv_load_failure_policy', 'fail')!r}")
    return [f"kvtier vLLM connector: configuration OK ({head})", *start,
            f"store: policy {s.policy}, hash {s.hash}, write_through {str(s.write_through).lower()}, "
            f"pin_ttl {s.pin_ttl:g} s",
            f"namespace: model {model}; revision {revision}; salt {'set' if cfg.salt else 'none'}",
            f"failure policy: {failure}",
            "not checked here: the model's block size against the capacities, vLLM's own memory, "
            "whether peers and the directory answer"]


def run(args: argparse.Namespace) -> int:
    from kvtier.integrations.vllm.config import parse_config

    given = read_json(args.config)
    is_whole = any(k in VLLM_FIELDS or k.startswith("kv_") for k in given)   # kv_*: a mistyped field of vLLM's
    extra = check_vllm_fields(given) if is_whole else given
    cfg = parse_config(extra)
    for line in summary(given if is_whole else None, cfg, check_start(cfg, args.tensor_parallel_size)):
        print(line)
    return 0
