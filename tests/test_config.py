"""kvtier.StoreConfig: one strict configuration, one set of defaults, for the CLI, the
reference engine and the vLLM connector."""
from __future__ import annotations

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
        assert f"disk_capacity, {defaults.disk_capacity}" in text


def test_cli_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "kv.json"
    bad.write_text(json.dumps({"host_capcity": "1GiB"}))
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--config", str(bad)), 2, "did you mean 'host_capacity'")
    r = run_kvtier("node", "--config", str(tmp_path / "none.toml"), env={**os.environ, "KVTIER_SECRET": "s" * 32})
    assert_one_line_error(r, 2, "cannot read the config file")


def test_cli_flags_override_the_file(tmp_path):
    f = tmp_path / "kv.toml"
    f.write_text('device_capacity = "1KiB"\nhost_capacity = "16MiB"\n')   # too small for one page: refused
    assert_one_line_error(run_kvtier("generate", "--prompt", "hi", "--config", str(f)), 2, "--kv-cache", "smaller than one KV block")
    r = run_kvtier("generate", "--prompt", "hi", "--max-tokens", "2", "--json", "--config", str(f), "--kv-cache", "8MiB")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["finish_reason"] == "length"
