"""kvtier.StoreConfig: one strict configuration, one set of defaults, for the CLI, the
reference engine and the vLLM connector."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import kvtier
from kvtier.config import StoreConfig
from kvtier.integrations.vllm.config import parse_config
from tests.conftest import assert_one_line_error, run_kvtier

LAYOUT = kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=16, rope_dim=16, block_tokens=16, dtype=torch.float32)
NS = kvtier.Namespace("config-test", "r1")


def test_unknown_setting_names_the_closest_known_one():
    with pytest.raises(kvtier.ConfigError, match=r"unknown setting 'disk_capcity'.*did you mean 'disk_capacity'"):
        StoreConfig.from_dict({"disk_capcity": "1GiB"})
    with pytest.raises(kvtier.ConfigError, match="unknown setting 'zzz'.*known: block_tokens"):
        StoreConfig.from_dict({"zzz": 1})
    with pytest.raises(kvtier.ConfigError, match="unknown setting 'hots_capacity'"):
        StoreConfig().replace(hots_capacity="1GiB")
    with pytest.raises(kvtier.ConfigError, match="did you mean 'host_capacity'"):
        StoreConfig(host_capcity="1GiB")                   # the constructor too (was a bare TypeError)


@pytest.mark.parametrize("settings, match", [
    ({"host_capacity": "lots"}, "cannot parse size"),
    ({"block_tokens": 0}, "block_tokens must be a whole number >= 1"),
    ({"pin_budget": 0.95}, r"pin_budget must be a number in \[0, 0.9\]"),
    ({"pin_ttl": 0}, "pin_ttl"),
    ({"hash": "md5"}, "hash must be one of"),
    ({"write_through": "yes"}, "write_through must be true or false"),
    ({"disk_direct": "auto"}, "disk_direct"),
])
def test_bad_values_say_what_is_expected(settings, match):
    with pytest.raises(kvtier.ConfigError, match=match):
        StoreConfig.from_dict(settings)


def test_json_and_toml_files(tmp_path):
    j = tmp_path / "kv.json"
    j.write_text(json.dumps({"host_capacity": "8MiB", "policy": "arc", "pin_ttl": 30}))
    t = tmp_path / "kv.toml"
    t.write_text('host_capacity = "8MiB"\npolicy = "arc"\npin_ttl = 30\n')
    assert StoreConfig.from_file(j) == StoreConfig.from_file(t) == StoreConfig(host_capacity="8MiB", policy="arc",
                                                                                pin_ttl=30)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(kvtier.ConfigError, match="is not valid JSON"):
        StoreConfig.from_file(tmp_path / "bad.json")
    with pytest.raises(kvtier.ConfigError, match="cannot read the config file"):
        StoreConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(kvtier.ConfigError, match="one object of settings"):
        StoreConfig.from_file(tmp_path / "list.json")
    upper = tmp_path / "KV.TOML"                         # the suffix in any case
    upper.write_text(t.read_text())
    assert StoreConfig.from_file(upper) == StoreConfig.from_file(t)
    (tmp_path / "twice.json").write_text('{"host_capacity": "8MiB", "host_capacity": "1GiB"}')
    with pytest.raises(kvtier.ConfigError, match="'host_capacity' is given twice"):
        StoreConfig.from_file(tmp_path / "twice.json")    # not silently the last one
    (tmp_path / "kv.yaml").write_text("host_capacity: 8MiB\n")
    with pytest.raises(kvtier.ConfigError, match="YAML config files are not read; give the same settings as JSON"):
        StoreConfig.from_file(tmp_path / "kv.yaml")


def test_build_makes_the_tiers_asked_for(tmp_path):
    c = StoreConfig(host_capacity="4MiB", disk_path=str(tmp_path / "kv"), disk_capacity="8MiB", policy="arc",
                    write_through=True, device_capacity="2MiB")
    with c.build(LAYOUT, NS) as store:
        assert [t.kind for t in store.tiers] == ["host", "disk"]
        assert store.write_through and store.tiers[0].capacity_bytes == 4 << 20
    with c.build(LAYOUT, NS, device="cpu", subdir="rank0") as store:
        assert [t.kind for t in store.tiers] == ["device", "host", "disk"]
        assert store.tiers[0].capacity_bytes == 2 << 20 and (tmp_path / "kv" / "rank0").is_dir()
    with pytest.raises(kvtier.ConfigError, match="no tier"):
        StoreConfig(host_capacity=None).build(LAYOUT, NS)


def test_a_block_tokens_given_must_match_the_layout_the_default_gives_way(tmp_path):
    """build() took the layout's block size and dropped a block_tokens the user gave, silently."""
    with pytest.raises(kvtier.ConfigError, match=r"block_tokens is 32, but .* hold 16 tokens: set block_tokens to 16"):
        StoreConfig(block_tokens=32, host_capacity="1MiB").build(LAYOUT, NS)
    f = tmp_path / "kv.toml"
    f.write_text("block_tokens = 8\n")
    with pytest.raises(kvtier.ConfigError, match="set block_tokens to 16"):
        StoreConfig.from_file(f).replace(host_capacity="1MiB").build(LAYOUT, NS)
    with pytest.raises(kvtier.ConfigError, match="set block_tokens to 16"):    # a command's flag too
        StoreConfig.from_command(None, {"block_tokens": ("--block-tokens", 64)})[0].build(LAYOUT, NS)
    small = kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=16, rope_dim=16, block_tokens=4, dtype=torch.float32)
    # left out, the layout's is taken (vLLM's block size), also after replace(), which passes
    # every field on; one given that agrees is fine
    for config in (StoreConfig(host_capacity="1MiB"), StoreConfig(host_capacity="1MiB").replace(policy="arc"),
                   dataclasses.replace(StoreConfig(host_capacity="1MiB"), policy="arc"),   # names every field
                   StoreConfig.from_command(None, {"block_tokens": ("--block-tokens", None)})[0]
                   .replace(host_capacity="1MiB"),
                   StoreConfig(block_tokens=4, host_capacity="1MiB")):
        with config.build(small, NS) as store:
            assert store.layout.block_tokens == 4


def test_a_disk_path_from_home_is_expanded(monkeypatch, tmp_path):
    """"~/kv" in a config file (no shell expands it) made a folder named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert StoreConfig(disk_path="~/kv").disk_path == str(tmp_path / "kv")
    assert StoreConfig(disk_path="/srv/~kv").disk_path == "/srv/~kv"


def test_a_disk_tier_keeps_its_size_unless_one_is_given(tmp_path, monkeypatch):
    """Reopened without disk_capacity, a tier keeps its present size (a 64 GiB folder opened
    with the defaults was shrunk to 16 GiB, dropping blocks); a new folder gets the default."""
    import kvtier.config
    small = StoreConfig(host_capacity=None, disk_path=str(tmp_path / "kv"), disk_capacity="256KiB")
    with small.build(LAYOUT, NS) as store:
        keys = store.keys(list(range(LAYOUT.block_tokens * 3)))
        store.put(keys, torch.ones(3, LAYOUT.block_bytes, dtype=torch.uint8))
        n = store.tiers[0].capacity_blocks
    with small.replace(disk_capacity=None).build(LAYOUT, NS) as store:
        assert store.tiers[0].capacity_blocks == n and store.lookup(keys).blocks == 3
    with small.replace(disk_capacity="128KiB").build(LAYOUT, NS) as store:    # given: it shrinks
        assert store.tiers[0].capacity_blocks == n // 2
    # Its slab deleted or cut short behind its back, the tier keeps the size its index
    # recorded (the slab's size alone brought it back at the 16 GiB default).
    for damage in ("delete", "truncate"):
        slab = tmp_path / "kv" / "slab.bin"
        slab.unlink() if damage == "delete" else os.truncate(slab, 4096)
        with small.replace(disk_capacity=None).build(LAYOUT, NS) as store:
            assert store.tiers[0].capacity_blocks == n // 2, damage
        assert slab.stat().st_size == n // 2 * store.tiers[0].slot_bytes
    assert kvtier.config.DEFAULT_DISK_CAPACITY == "16GiB"
    monkeypatch.setattr(kvtier.config, "DEFAULT_DISK_CAPACITY", "64KiB")    # not 16 GiB of this disk
    fresh = StoreConfig(host_capacity=None, disk_path=str(tmp_path / "new"))
    assert fresh.disk_capacity is None
    with fresh.build(LAYOUT, NS) as store:
        assert store.tiers[0].capacity_blocks == (64 << 10) // LAYOUT.block_bytes


def test_bad_settings_and_arguments_are_config_errors(tmp_path):
    with pytest.raises(kvtier.ConfigError, match="disk_io_threads must be at most 64"):
        StoreConfig(disk_io_threads=100)                  # was accepted, then refused as "io_threads" at build()
    with pytest.raises(kvtier.ConfigError, match="unknown setting 'nope'"):
        StoreConfig.default("nope")
    for bad in (None, b"kv.json", ""):
        with pytest.raises(kvtier.ConfigError, match="a config file is a path"):
            StoreConfig.from_file(bad)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(kvtier.ConfigError, match="nested too deeply"):
        StoreConfig.from_file(deep)
    c = StoreConfig(host_capacity=None, disk_path=str(tmp_path / "kv"), disk_capacity="1MiB")
    for sub in ("../escape", str(tmp_path / "abs")):
        with pytest.raises(kvtier.ConfigError, match="subdir must be a relative folder name inside disk_path"):
            c.build(LAYOUT, NS, subdir=sub)
    assert not (tmp_path / "escape").exists() and not (tmp_path / "abs").exists()


def test_engine_connector_and_cli_share_the_defaults():
    """Each builder takes what it is not told from StoreConfig(): the same object."""
    import inspect

    from kvtier.engine import llm

    defaults = StoreConfig()
    assert parse_config({}).store == defaults
    assert "cache or StoreConfig()" in inspect.getsource(llm.LLM.__init__)
    for command in ("node", "generate"):
        r = run_kvtier(command, "--help")
        assert r.returncode == 0
        text = " ".join(r.stdout.split())
        assert f"host_capacity, {defaults.host_capacity}" in text
        assert f"disk_capacity, {StoreConfig.shown_default('disk_capacity')}" in text


def test_cli_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "kv.json"
    bad.write_text(json.dumps({"host_capcity": "1GiB"}))
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--config", str(bad)), 2, "did you mean 'host_capacity'")
    r = run_kvtier("node", "--config", str(tmp_path / "none.toml"), env={**os.environ, "KVTIER_SECRET": "s" * 32})
    assert_one_line_error(r, 2, "cannot read the config file")
    # a flag the command would ignore is refused, not dropped
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--disk-cache", "1GiB"), 2,
                          "--disk-cache sizes a disk tier but there is none: give --disk DIR")


def test_cli_flags_override_the_file(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text('device_capacity = "1KiB"\nhost_capacity = "16MiB"\n')   # too small for one page: refused
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--config", str(f)), 2,
                          f"device_capacity 1.00 KiB in {f}", "smaller than one KV block")
    r = run_kvtier("generate", "--prompt", "hi", "--max-tokens", "2", "--json", "--config", str(f), "--kv-cache", "8MiB")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["finish_reason"] == "length"


# -- the audit's defects: a setting is named as the user gave it; "no host tier" in a file;
#    strict booleans and finite numbers ------------------------------------------------------

def _error_line(r) -> str:
    assert_one_line_error(r, 2)
    return next(ln for ln in r.stderr.splitlines() if ln.startswith("kvtier: error:"))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_file_value_too_small_is_named_by_its_key_and_file_not_a_flag(tmp_path, command):
    if command == "serve":
        pytest.importorskip("uvicorn")
        pytest.importorskip("starlette")
    extra = ["--prompt", "hi", "--max-tokens", "1"] if command == "generate" else ["--port", "0"]
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"host_capacity": 5}))
    line = _error_line(run_kvtier(command, "--config", str(host), *extra, timeout=120))
    assert f"host_capacity 5 B in {host} is smaller than one KV block" in line and "--host-cache" not in line
    assert "block_tokens 16 (the default)" in line and "--block-tokens" not in line
    blocks = tmp_path / "blocks.toml"
    blocks.write_text("block_tokens = 100000000\n")
    line = _error_line(run_kvtier(command, "--config", str(blocks), *extra, timeout=120))
    assert "device_capacity 256.00 MiB (the default) is smaller" in line
    assert f"block_tokens 100000000 in {blocks}" in line and "--block-tokens" not in line
    line = _error_line(run_kvtier(command, "--config", str(blocks), "--kv-cache", "1GiB", *extra, timeout=120))
    assert line.startswith("kvtier: error: --kv-cache 1.00 GiB is smaller") and f"block_tokens 100000000 in {blocks}" in line


def test_check_capacities_names_flags_file_keys_and_defaults(tmp_path):
    import argparse

    from kvtier.engine.generate_cli import cache_config, check_capacities

    f = tmp_path / "kv.toml"
    f.write_text('device_capacity = "1KiB"\nhost_capacity = 5\n')
    args = argparse.Namespace(config=str(f), block_tokens=None, kv_cache=None, host_cache=None, disk=None,
                              disk_cache=None)
    cache, sources = cache_config(args)
    with pytest.raises(kvtier.ConfigError) as e:
        check_capacities(cache, 4096, sources)
    assert str(e.value).startswith(f"device_capacity 1.00 KiB in {f} is smaller") and "--kv-cache" not in str(e.value)
    args.kv_cache, args.block_tokens = 1 << 20, 32
    cache, sources = cache_config(args)
    with pytest.raises(kvtier.ConfigError) as e:
        check_capacities(cache, 4096, sources)
    assert str(e.value).startswith(f"host_capacity 5 B in {f} is smaller") and "at --block-tokens 32" in str(e.value)
    args.host_cache = 8 << 20                  # the flag over the file
    cache, sources = cache_config(args)
    check_capacities(cache, 4096, sources)
    args.kv_cache = 1024
    cache, sources = cache_config(args)
    with pytest.raises(kvtier.ConfigError, match=r"^--kv-cache 1.00 KiB is smaller"):
        check_capacities(cache, 4096, sources)
    args.kv_cache, args.disk, args.disk_cache = 1 << 20, str(tmp_path / "d"), 6000   # >= a block, < a 8 KiB slot
    cache, sources = cache_config(args)
    with pytest.raises(kvtier.ConfigError, match=r"^--disk-cache 5.86 KiB is smaller than one disk slot "
                                                 r"\(5000-byte blocks rounded up to 4096\) of this model \(8192 bytes"):
        check_capacities(cache, 5000, sources)


@pytest.mark.parametrize("text", ['host_capacity = 0', 'host_capacity = "none"', 'host_capacity = "None"',
                                  'host_capacity = "0"', 'host_capacity = " none "'])
def test_a_toml_file_can_say_no_host_tier_as_the_flag_does(tmp_path, text):
    f = tmp_path / "kv.toml"
    f.write_text(text + "\n")
    assert StoreConfig.from_file(f).host_capacity is None
    assert StoreConfig.from_file(f) == StoreConfig(host_capacity=None)
    assert StoreConfig.from_command(str(f), {})[0].host_capacity is None


def test_no_host_tier_from_json_null_and_from_the_flag_and_a_flag_over_it(tmp_path):
    j = tmp_path / "kv.json"
    j.write_text(json.dumps({"host_capacity": None}))
    assert StoreConfig.from_file(j).host_capacity is None
    for given in (0, "none"):
        assert StoreConfig.from_command(None, {"host_capacity": ("--host-cache", given)})[0].host_capacity is None
    t = tmp_path / "kv.toml"
    t.write_text("host_capacity = 0\n")
    config, sources = StoreConfig.from_command(str(t), {"host_capacity": ("--host-cache", 8 << 20)})
    assert config.host_capacity == 8 << 20 and sources.describe("host_capacity", "8 MiB") == "--host-cache 8 MiB"


@pytest.mark.parametrize("given", [None, 0, "0", "none", "None", "0GiB"])
def test_no_host_tier_reads_the_same_in_python(given):
    """StoreConfig(host_capacity=0) means what `host_capacity = 0` in a file and
    `--host-cache 0` mean (it was a "0 B is smaller than one block" error at build)."""
    assert StoreConfig(host_capacity=given).host_capacity is None
    assert StoreConfig(host_capacity=given) == StoreConfig(host_capacity=None)
    assert StoreConfig().replace(host_capacity=given).host_capacity is None


@pytest.mark.parametrize("value", ["false", "true", '"lots"', "-1", '"nothing"'])
def test_other_host_capacities_are_not_read_as_no_host_tier(tmp_path, value):
    f = tmp_path / "kv.toml"
    f.write_text(f"host_capacity = {value}\n")
    with pytest.raises(kvtier.ConfigError, match="host_capacity") as e:
        StoreConfig.from_file(f)
    assert str(f) in str(e.value)


def test_generate_runs_without_a_host_tier_from_a_toml_file(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text('host_capacity = 0\ndevice_capacity = "4MiB"\n')
    r = run_kvtier("generate", "--prompt", "hi", "--max-tokens", "1", "--json", "--config", str(f))
    assert r.returncode == 0, r.stderr
    f.write_text('host_capacity = "none"\ndevice_capacity = "4MiB"\n')
    r = run_kvtier("generate", "--prompt", "hi", "--max-tokens", "1", "--json", "--config", str(f))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("settings, match", [
    ({"disk_direct": 1}, "disk_direct must be true, false or null"),
    ({"disk_direct": 0}, "disk_direct must be true, false or null"),
    ({"write_through": 1}, "write_through must be true or false"),
    ({"promote": 0}, "promote must be true or false"),
    ({"pin_ttl": float("inf")}, "pin_ttl must be a finite number"),
    ({"pin_ttl": float("-inf")}, "pin_ttl must be a finite number"),
    ({"pin_ttl": 10 ** 400}, "pin_ttl must be a finite number"),          # past a float: time.time() + it fails
    ({"pin_ttl": float("nan")}, "pin_ttl must be a finite number"),
    ({"pin_budget": float("nan")}, r"pin_budget must be a number in \[0, 0.9\]"),
    ({"pin_budget": float("inf")}, r"pin_budget must be a number in \[0, 0.9\]"),
])
def test_booleans_are_booleans_and_numbers_are_finite(settings, match):
    with pytest.raises(kvtier.ConfigError, match=match):
        StoreConfig.from_dict(settings)
    with pytest.raises(kvtier.ConfigError, match=match):
        StoreConfig(**settings)


def test_real_booleans_and_null_disk_direct_still_work():
    for v in (True, False, None):
        assert StoreConfig(disk_direct=v).disk_direct is v
    assert StoreConfig.from_dict({"write_through": True, "promote": False, "pin_ttl": 1e9}).pin_ttl == 1e9


@pytest.mark.parametrize("name, text, match", [
    ("kv.toml", "disk_direct = 1", "disk_direct must be true, false or null"),
    ("kv.toml", "write_through = 1", "write_through must be true or false"),
    ("kv.toml", "pin_ttl = inf", "pin_ttl must be a finite number"),
    ("kv.toml", "pin_budget = nan", "pin_budget must be a number in"),
    ("kv.json", '{"pin_ttl": Infinity}', "pin_ttl must be a finite number"),
    ("kv.toml", 'host_capacity = "lots"', "host_capacity: cannot parse size 'lots'"),
])
def test_cli_refuses_bad_file_values_naming_the_file(tmp_path, name, text, match):
    f = tmp_path / name
    f.write_text(text + "\n")
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--max-tokens", "1", "--config", str(f)), 2,
                          match, str(f))


def test_serve_pin_ttl_flag_must_be_finite():
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    r = run_kvtier("serve", "--port", "0", "--pin-ttl", "inf", timeout=120)   # refused before the model loads
    assert_one_line_error(r, 2, "--pin-ttl", "finite")


def test_settings_with_nothing_to_act_on_are_refused_not_ignored(tmp_path):
    """Write-through with no disk and a backup with no tier below were taken and did nothing.
    (A disk_capacity without disk_path stays allowed: one config may size a disk that only
    some runs turn on by giving the path, as `kvtier bench engine` does.)"""
    with pytest.raises(kvtier.ConfigError, match="write_through=True .* this store has none"):
        StoreConfig(write_through=True).build(LAYOUT, NS)
    with pytest.raises(kvtier.ConfigError, match="backup=True .* this store has one tier"):
        kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=4)], NS, backup=True)
    with StoreConfig(write_through=True, disk_path=str(tmp_path / "kv"), disk_capacity="4MiB").build(LAYOUT, NS) as s:
        assert s.write_through


def test_an_engine_given_a_store_refuses_a_cache_that_would_size_another():
    from kvtier.engine import LLM
    with LLM("kimi-tiny", cache=StoreConfig(host_capacity=None)) as llm:
        with pytest.raises(kvtier.ConfigError, match="cache= sets host_capacity, disk_path, which store= decides"):
            LLM("kimi-tiny", store=llm.store, cache=StoreConfig(host_capacity=None, disk_path="/tmp/never"))
        assert not os.path.exists("/tmp/never")
