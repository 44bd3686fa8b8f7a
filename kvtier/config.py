"""One configuration for every store kvtier builds: the CLI's, the reference engine's and
the vLLM connector's. The defaults live here and nowhere else (docs/config.md).

    config = kvtier.StoreConfig(host_capacity="8GiB", disk_path="/nvme/kv")
    config = kvtier.StoreConfig.from_file("kvtier.toml")        # or .json; unknown keys refused
    config, sources = kvtier.StoreConfig.from_command("kv.toml", {"host_capacity": ("--host-cache", None)})
    store = config.build(layout, namespace)                     # host -> disk
    store = config.build(layout, namespace, device="cuda:0")    # engine pages -> host -> disk
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from kvtier.backup import AUTO_MIN_RATIO, valid_backup
from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_POLICY, make_policy, policy_names
from kvtier.units import parse_bytes

if TYPE_CHECKING:
    import torch

    from kvtier.keys import Namespace
    from kvtier.layout import KVLayout
    from kvtier.net.remote import Remote
    from kvtier.store import Store


#: A new disk tier's size when disk_capacity is not given (allocated up front; refused if it
#: does not fit). An existing tier keeps its size unless disk_capacity is given: reopening a
#: 64 GiB folder without the setting must not shrink it (a shrink drops blocks).
DEFAULT_DISK_CAPACITY = "16GiB"
#: A bound on disk_io_threads, a setting that costs a thread and a staging buffer each.
MAX_DISK_IO_THREADS = 64


@dataclass(frozen=True)
class StoreConfig:
    """What a store is made of and how it behaves. Sizes are bytes or strings like "8GiB"."""

    block_tokens: int = 16                   # tokens per block (an engine with its own page size uses that)
    device_capacity: int | str = "256MiB"    # the device tier: the KV pages of an engine whose pages are kvtier's
    host_capacity: int | str | None = "1GiB"  # host memory (pinned where CUDA is); None: no host tier
    disk_path: str | None = None             # a disk tier's directory, kept across runs; None: no disk tier
    disk_capacity: int | str | None = None   # None: the folder's present size, DEFAULT_DISK_CAPACITY for a new one
    disk_direct: bool | None = None          # O_DIRECT: None = where the filesystem allows it
    disk_io_threads: int = 4                 # parallel disk reads and writes
    policy: str = DEFAULT_POLICY             # eviction (+ admission) policy, kvtier.policies
    hash: str = "xxh3"                       # block keys: xxh3, sha256 or blake3
    pin_budget: float = 0.5                  # share of each tier session pins may hold
    pin_ttl: float = 600.0                   # seconds a session's prefix stays pinned after its last turn
    write_through: bool = False              # write each new block to disk at once (else on eviction/flush)
    promote: bool = True                     # copy blocks read from lower tiers up into the top tier
    backup: bool | str = "auto"              # copy blocks an engine caches in its pages one tier down, in the background;
                                             # "auto": where that tier holds 2x the pages' blocks (kvtier.backup)
    io_threads: int = 1                      # store threads for non-blocking get/put

    #: The settings the caller gave (not a field: neither compared nor shown). build() takes
    #: the layout's block size over the default block_tokens, but refuses one that was given.
    _given: ClassVar[frozenset[str]] = frozenset()

    def __new__(cls, *args: Any, **settings: Any) -> StoreConfig:
        # Before the dataclass's __init__, whose TypeError for a misspelled keyword names no
        # close match: StoreConfig(host_capcity="1GiB") says "did you mean 'host_capacity'?".
        check_names(settings, cls.fields(), "StoreConfig")
        config = super().__new__(cls)
        given = frozenset(cls.fields()[:len(args)]) | frozenset(settings)
        # Every field named: dataclasses.replace (or copy.replace), which passes them all and so
        # cannot tell what was given; StoreConfig.replace records its own changes after it.
        object.__setattr__(config, "_given", frozenset() if given == frozenset(cls.fields()) else given)
        return config

    def __post_init__(self) -> None:
        if no_host_tier(self.host_capacity):     # 0, "0GiB" or "none": no host tier, however it is given
            object.__setattr__(self, "host_capacity", None)
        for name in ("block_tokens", "disk_io_threads", "io_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}")
        if self.disk_io_threads > MAX_DISK_IO_THREADS:
            raise ConfigError(f"disk_io_threads must be at most {MAX_DISK_IO_THREADS} (each holds an 8 MiB "
                              f"buffer), got {self.disk_io_threads}")
        for name in ("device_capacity", "host_capacity", "disk_capacity"):
            v = getattr(self, name)
            if v is None and name in ("host_capacity", "disk_capacity"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise ConfigError(f"{name} must be a size like '8GiB' or a number of bytes, got {v!r}")
            try:
                parse_bytes(v)
            except ConfigError as e:         # says what a size looks like; name the setting too
                raise ConfigError(f"{name}: {e}") from None
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ConfigError(f"disk_path must be a directory path (a string), got {self.disk_path!r}")
        if self.disk_path is not None and self.disk_path.startswith("~"):
            # "~/kv" in a config file or a connector's settings made a folder named "~" in the
            # working directory: no shell expands it there
            object.__setattr__(self, "disk_path", os.path.expanduser(self.disk_path))
        if self.disk_direct is not None and not isinstance(self.disk_direct, bool):   # 1 == True: not a boolean
            raise ConfigError(f"disk_direct must be true, false or null (O_DIRECT where allowed), got {self.disk_direct!r}")
        for name in ("write_through", "promote"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not valid_backup(self.backup):
            raise ConfigError(f"backup must be true, false or \"auto\" (where the tier below holds "
                              f"{AUTO_MIN_RATIO:g}x the top tier's blocks), got {self.backup!r}")
        if not isinstance(self.policy, str) or not self.policy:
            raise ConfigError(f"policy must be a policy name like {DEFAULT_POLICY!r} (one of {', '.join(policy_names())}; docs/policies.md)")
        make_policy(self.policy, 1)          # an unknown name fails here, not when a store is built
        from kvtier.keys import HASHES
        if self.hash not in HASHES:
            raise ConfigError(f"hash must be one of {', '.join(HASHES)}, got {self.hash!r}")
        for name, what in (("pin_budget", "a number in [0, 0.9]"), ("pin_ttl", "a finite number of seconds > 0")):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v)
                    or not (0 <= v <= 0.9 if name == "pin_budget" else v > 0)):
                raise ConfigError(f"{name} must be {what}, got {v!r}")

    # -- from settings -------------------------------------------------------------------
    @classmethod
    def fields(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any], *, where: str = "store config") -> StoreConfig:
        """A config from a mapping of field names; an unknown name is a ConfigError that
        suggests the closest known one (a typo must not silently mean "default")."""
        if not isinstance(settings, Mapping):
            raise ConfigError(f"the {where} must be a mapping of settings, not {type(settings).__name__}")
        check_names(settings, cls.fields(), where)
        try:
            return cls(**dict(settings))
        except ConfigError as e:             # the setting is named; say where it was given
            raise ConfigError(f"{e} (in the {where})") from None

    @classmethod
    def from_file(cls, path: str | Path) -> StoreConfig:
        """A config from a JSON or TOML (.toml) file of settings; host_capacity 0 or "none"
        there means no host tier (TOML has no null), as --host-cache 0 / none does."""
        return cls.from_dict(read_settings(path), where=f"config file {path}")

    @classmethod
    def default(cls, name: str) -> Any:
        """A field's default (for help texts: the one place defaults are written)."""
        check_names({name: None}, cls.fields(), "StoreConfig")
        return next(f.default for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def shown_default(cls, name: str) -> str:
        """A field's default as a help text gives it."""
        if name == "disk_capacity":
            return f"the folder's present size, {DEFAULT_DISK_CAPACITY} for a new one"
        return str(cls.default(name))

    @classmethod
    def from_command(cls, path: str | None,
                     flags: Mapping[str, tuple[str, Any]]) -> tuple[StoreConfig, SettingSources]:
        """A command's config and where each setting came from (for messages that name it as the
        user gave it). `flags` maps a setting to (its flag, the value given or None); a given
        flag overrides the file `path` (or the default). host_capacity 0 or "none": no host tier."""
        settings = read_settings(path) if path else {}
        config = cls.from_dict(settings, where=f"config file {path}") if path else cls()
        given = {name: (flag, v) for name, (flag, v) in flags.items() if v is not None}
        for name, (flag, v) in given.items():
            try:
                config = config.replace(**{name: v})
            except ConfigError as e:         # the message names the setting; say which flag gave it
                raise ConfigError(f"{flag}: {e}" if flag != name else str(e)) from None
        return config, SettingSources({name: flag for name, (flag, _) in flags.items()}, frozenset(given),
                                      str(path) if path else None, frozenset(settings))

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with some fields changed (e.g. command-line flags over a file's settings)."""
        check_names(changes, self.fields(), "store config")
        changed = dataclasses.replace(self, **changes)
        # (dataclasses.replace passes every field: the settings given are these and ours)
        object.__setattr__(changed, "_given", self._given | frozenset(changes))
        return changed

    # -- a store -------------------------------------------------------------------------
    def check_block_tokens(self, page_tokens: int) -> None:
        """A store's blocks are its layout's (an engine's pages): a block_tokens the user gave
        that differs is a ConfigError saying which value to give. The default gives way
        silently (vLLM's block size, an engine's own pages)."""
        if "block_tokens" in self._given and self.block_tokens != page_tokens:
            raise ConfigError(f"block_tokens is {self.block_tokens}, but the layout's blocks (the engine's pages) "
                              f"hold {page_tokens} tokens: set block_tokens to {page_tokens}, or leave it out to "
                              "take the layout's")

    def build(self, layout: KVLayout, namespace: Namespace, *, device: str | torch.device | None = None,
              remote: Remote | None = None, subdir: str = "") -> Store:
        """The store this config describes. With `device` (where an engine's KV pages live,
        e.g. "cuda:0" or "cpu"), a DeviceTier of device_capacity comes first: the engine's
        pages. `subdir` is appended to disk_path (one store per namespace or rank)."""
        from kvtier.store import Store
        from kvtier.tiers import DeviceTier, DiskTier, HostTier, Tier
        from kvtier.tiers.disk_dir import present_blocks

        self.check_block_tokens(layout.block_tokens)
        tiers: list[Tier] = []
        if device is not None:
            tiers.append(DeviceTier(self.device_capacity, device=device, name="device"))
        if self.host_capacity is not None:
            tiers.append(HostTier(self.host_capacity, name="host"))
        if not isinstance(subdir, str) or Path(subdir).is_absolute() or ".." in Path(subdir).parts:
            raise ConfigError(f"subdir must be a relative folder name inside disk_path, got {subdir!r}")
        if self.disk_path is not None:
            path = Path(self.disk_path) / subdir if subdir else Path(self.disk_path)
            n = present_blocks(path, layout.block_bytes) if self.disk_capacity is None else 0
            size = ({"blocks": n} if n else
                    {"capacity": DEFAULT_DISK_CAPACITY if self.disk_capacity is None else self.disk_capacity})
            tiers.append(DiskTier(path, **size, name="disk", direct=self.disk_direct,
                                  io_threads=self.disk_io_threads))
        if not tiers:
            raise ConfigError("this config has no tier: give host_capacity, disk_path, or a device for engine pages")
        return Store(layout, tiers, namespace, remote=remote, policy=self.policy, hash=self.hash,
                     pin_budget=self.pin_budget, write_through=self.write_through, promote=self.promote,
                     backup=self.backup, io_threads=self.io_threads)


@dataclass(frozen=True)
class SettingSources:
    """Where each setting of a command's config came from: a flag the user passed, their config
    file, or the default. A message about a value names it the way the user gave it, never a
    flag they did not pass."""

    flags: Mapping[str, str] = field(default_factory=dict)   # setting -> the command's flag for it
    given: frozenset[str] = frozenset()                       # settings set by a flag the user passed
    path: str | None = None                                   # the config file
    in_file: frozenset[str] = frozenset()                     # settings the file set

    def describe(self, name: str, shown: str) -> str:
        """Setting `name` with its value `shown`: "--kv-cache 1.00 KiB", "device_capacity
        1.00 KiB in kv.toml" or "device_capacity 256.00 MiB (the default)"."""
        if name in self.given:
            return f"{self.flags[name]} {shown}"
        if name in self.in_file:
            return f"{name} {shown} in {self.path}"
        return f"{name} {shown} (the default)"

    def setter(self, name: str) -> str:
        """What changes setting `name`, for advice: the flag or the file's key the user gave,
        else both ways ("--kv-cache (or device_capacity in a --config file)")."""
        flag = self.flags.get(name, name)
        if name in self.given or flag == name:
            return flag
        if name in self.in_file:
            return name
        return f"{flag} (or {name} in a --config file)"


def _finite(v: int | float) -> bool:
    """A float that is not NaN or infinite, or an int a float can hold (pin_ttl is added to
    time.time(): a 400-digit int would overflow there)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


# help() and IDEs show the fields, not __new__'s (*args, **settings)
StoreConfig.__signature__ = inspect.signature(StoreConfig.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(StoreConfig.__init__).parameters.values())[1:])


def no_host_tier(value: Any) -> bool:
    """Whether a host_capacity value means no host tier: None, 0, "none" (any case) or a size
    string of 0 bytes ("0", "0GiB"), as `--host-cache` takes it and as a TOML file (which has
    no null) can write it. Anything unparsable is left to the size checks."""
    if value is None:
        return True
    if isinstance(value, bool):              # false is not a size: refused as one
        return False
    if isinstance(value, int):
        return value == 0
    if not isinstance(value, str):
        return False
    if value.strip().lower() == "none":
        return True
    try:
        return parse_bytes(value) == 0
    except ConfigError:
        return False


def check_names(settings: Mapping[str, Any], known: list[str], where: str) -> None:
    """ConfigError for the first unknown setting, with the closest known name."""
    for name in settings:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
            raise ConfigError(f"unknown setting {name!r} in the {where}{hint}")


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a name given twice is a ValueError (TOML refuses it too)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"{k!r} is given twice")
        out[k] = v
    return out


def parse_json(text: str, where: str, hint: str = "") -> Any:
    """JSON settings from `text` (`where` names it in errors, `hint` follows a syntax error): a
    name given twice in an object (JSON would keep the last) or nesting too deep for the parser
    is a ConfigError too."""
    try:
        return json.loads(text, object_pairs_hook=_no_repeats)
    except ValueError as e:
        raise ConfigError(f"{where} is not valid JSON: {e}{hint}") from None
    except RecursionError:
        raise ConfigError(f"{where}: objects or arrays nested too deeply; settings are one flat object") from None


#: The largest config file read: far above any real one (a few hundred bytes), so a wrong
#: path (a log, /dev/zero) is an error at once, not the process's memory filling up.
MAX_CONFIG_BYTES = 1 << 20


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """The bytes of the file at `path` (a `what`, e.g. "config file", for messages): a
    ConfigError naming the file if it cannot be read or holds more than `limit` bytes."""
    from kvtier.units import format_bytes
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"cannot read the {what} {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ConfigError(f"the {what} {path} is larger than {format_bytes(limit).replace('.00 ', ' ')}, the "
                          f"most kvtier reads of a {what}: give the right file")
    return data


def read_settings(path: str | Path) -> dict[str, Any]:
    """One object of settings from a JSON file, or a TOML file (.toml); a setting given twice
    is an error in either (JSON would silently keep the last)."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ConfigError(f"a config file is a path (a string), got {path!r}")
    p = Path(path)
    kind = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(p.suffix.lower(), "JSON")
    if kind == "YAML":
        raise ConfigError(f"{p}: YAML config files are not read; give the same settings as JSON or TOML "
                          "(docs/config.md)")
    try:
        text = read_bounded(p, MAX_CONFIG_BYTES, "config file").decode()
    except UnicodeDecodeError:
        raise ConfigError(f"the config file {p} is not text: give a JSON or TOML file") from None
    hint = "" if p.suffix.lower() in (".json", ".toml") else \
        f" (only *.toml files are read as TOML, others as JSON: if it is TOML, name it {p.stem}.toml)"
    if kind == "TOML":
        try:
            import tomllib
        except ImportError:      # Python 3.10
            raise ConfigError(f"{p}: TOML config files need Python 3.11+; use JSON") from None
        try:
            data = tomllib.loads(text)
        except ValueError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}{hint}") from None
    else:
        data = parse_json(text, str(p), hint)
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold one object of settings, e.g. {{\"host_capacity\": \"8GiB\"}}")
    return data
