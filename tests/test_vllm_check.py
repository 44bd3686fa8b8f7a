"""`kvtier vllm-check`: the vLLM connector's --kv-transfer-config checked before vLLM starts,
without vLLM. A good config exits 0 with a summary of the tiers; a bad one is one
`kvtier: error:` line (exit 2) naming the setting, as the worker would have failed on it
only after vLLM loaded the model."""
from __future__ import annotations

import io
import json
import socket
import subprocess
import sys

import pytest

from kvtier.cli import main
from tests.conftest import assert_one_line_error

VLLM = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both"}
SECRET = "0123456789abcdef0123"


def check(capsys, *args: str) -> subprocess.CompletedProcess:
    """`kvtier vllm-check ARGS` in this process (each run in a subprocess would import torch anew)."""
    code = main(["vllm-check", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def transfer(**extra) -> str:
    """A --kv-transfer-config naming kvtier's connector with these connector settings."""
    return json.dumps({**VLLM, "kv_connector_extra_config": extra})


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch):
    monkeypatch.delenv("KVTIER_SECRET", raising=False)


def test_a_good_config_passes_and_names_its_tiers(capsys, tmp_path):
    disk = tmp_path / "kv"
    r = check(capsys, transfer(host_capacity="64MiB", disk_path=str(disk), disk_capacity="32MiB",
                               peers=["10.0.0.2:7700"], secret=SECRET, failure_policy="keep"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert "configuration OK" in out and "kv_role kv_both" in out
    assert "host    64.00 MiB" in out
    assert f"disk    32.00 MiB, allocated at start in {disk}/MODEL-SEED" in out
    assert "remote  peers 10.0.0.2:7700" in out
    assert "cluster secret: set" in out
    assert "failure policy: keep" in out
    assert not disk.exists()        # checked, not created


def test_the_defaults_are_summarized(capsys):
    from kvtier.tiers.memory import memory_available
    avail = memory_available()[0]
    if avail is not None and avail < 3 << 29:
        pytest.skip("less than 1.5 GiB of memory available: the default 1 GiB host tier would be refused")
    r = check(capsys, transfer())
    assert r.returncode == 0, r.stderr
    assert "host    1.00 GiB" in r.stdout         # StoreConfig's default host tier
    assert "disk" not in r.stdout and "remote" not in r.stdout
    assert "listens on 127.0.0.1:0 (any free port)" in r.stdout
    assert "cluster secret: none" in r.stdout
    assert "failure policy: recompute" in r.stdout


def test_the_extra_config_alone_from_a_file_with_its_config_file(capsys, tmp_path):
    settings = tmp_path / "vllm.json"
    settings.write_text(json.dumps({"host_capacity": "48MiB"}))
    given = tmp_path / "extra.json"
    given.write_text(json.dumps({"config_file": str(settings)}))
    r = check(capsys, str(given))
    assert r.returncode == 0, r.stderr
    assert "kv_connector_extra_config only" in r.stdout
    assert "host    48.00 MiB" in r.stdout


def test_the_config_is_read_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(transfer(host_capacity="80MiB")))
    r = check(capsys, "-")
    assert r.returncode == 0, r.stderr
    assert "host    80.00 MiB" in r.stdout


@pytest.mark.parametrize("config, needles", [
    ('{"kv_connector": "KvtierConnector", "kv_role": ', ["not valid JSON"]),
    ("kv_connector=KvtierConnector", ["neither a JSON object", "nor a file"]),
    ('{"kv_conector": "KvtierConnector"}', ["'kv_conector'", "did you mean 'kv_connector'"]),   # not taken as extra
    ('{"host_capacity": "1GiB", "host_capacity": "2GiB"}', ["'host_capacity' is given twice"]),
    ('{"tiers": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nested too deeply"]),
    (json.dumps({**VLLM, "kv_connector": "LMCacheConnectorV1"}),
     ["kv_connector 'LMCacheConnectorV1'", "KvtierConnector"]),
    (json.dumps({k: v for k, v in VLLM.items() if k != "kv_connector_module_path"}),
     ["kv_connector_module_path is missing", "kvtier.integrations.vllm"]),
    (json.dumps({**VLLM, "kv_role": "both"}), ["kv_role 'both'", "kv_both"]),
    (json.dumps({**VLLM, "kv_connector_extra_confg": {}}),
     ["'kv_connector_extra_confg'", "did you mean 'kv_connector_extra_config'"]),
    (transfer(host_capacty="8GiB"), ["unknown kvtier connector setting", "host_capacty"]),
    (transfer(host_capacity="8 gigs"), ["host tier's capacity", "'8 gigs'"]),
    (transfer(config_file="/nonexistent/kvtier-vllm.json"), ["/nonexistent/kvtier-vllm.json"]),
    (transfer(peers=["10.0.0.2:7700"]), ["remote tier", "secret"]),
    (transfer(directory="http://10.0.0.9:6379", secret=SECRET), ["Redis URL", "redis://"]),
    (transfer(host_capacity="4096TiB"), ["host_capacity 4096.00 TiB", "available"]),
])
def test_a_bad_config_is_one_line_naming_the_setting(capsys, config, needles):
    assert_one_line_error(check(capsys, config), 2, *needles)


def test_a_disk_path_that_is_a_file_or_too_small(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_one_line_error(check(capsys, transfer(disk_path=str(afile))), 2, f"disk_path {afile} is a file")
    big = transfer(disk_path=str(tmp_path / "kv"), disk_capacity="4096TiB")
    assert_one_line_error(check(capsys, big), 2, "disk_capacity 4096.00 TiB", "not enough free space")


def test_a_disk_path_on_a_virtual_filesystem_is_refused(capsys):
    assert_one_line_error(check(capsys, transfer(disk_path="/proc/kvtier")), 2, "/proc/kvtier", "not on a disk")


def test_too_little_disk_space_beside_existing_folders_is_a_warning(capsys, tmp_path):
    # One of the folders there may be this model's (its slab allocated already): not an error.
    (tmp_path / "kv" / "llama-0123456789abcdef").mkdir(parents=True)
    (tmp_path / "kv" / "llama-0123456789abcdef" / "slab.bin").write_bytes(b"")
    r = check(capsys, transfer(disk_path=str(tmp_path / "kv"), disk_capacity="4096TiB"))
    assert r.returncode == 0, r.stderr
    assert "1 folder there already" in r.stdout
    assert "warning: less than 4096.00 TiB free" in r.stdout


def test_a_listen_port_in_use_is_refused(capsys):
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        r = check(capsys, transfer(listen=f"127.0.0.1:{port}"))
    assert_one_line_error(r, 2, f"127.0.0.1:{port}", "in use")


def test_each_tensor_parallel_rank_takes_its_own_host_tier(capsys, monkeypatch):
    monkeypatch.setattr("kvtier.tiers.memory.memory_available", lambda: (10 << 30, 16 << 30))
    config = transfer(host_capacity="6GiB")
    assert check(capsys, config).returncode == 0
    assert_one_line_error(check(capsys, "-tp", "2", config), 2, "6.00 GiB x 2 ranks", "10.00 GiB")


def test_vllm_is_not_imported():
    code = ("import sys; from kvtier.cli import main; code = main(['vllm-check', sys.argv[1]]); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'; sys.exit(code)")
    r = subprocess.run([sys.executable, "-c", code, transfer(host_capacity="64MiB")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "configuration OK" in r.stdout
