"""A user's mistake is one line `kvtier: error: ...` that says what to do: a damaged checkpoint,
a worker URL with a path, a TOML file not named .toml, an unknown hit-ratio policy, a huge
secret/salt/config file, an address-space limit, a host that cannot be listened on, an
unwritable --plot path; and a UCX node says it listens on every interface."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from kvtier.config import MAX_CONFIG_BYTES, read_bounded
from kvtier.errors import ConfigError
from kvtier.node_cli import MAX_KEY_FILE_BYTES
from tests.conftest import assert_one_line_error, run_kvtier

SECRET_ENV = {**os.environ, "KVTIER_SECRET": "0123456789abcdef0123"}
NODE = ("node", "--layout", "llama3-8b", "--capacity", "64MiB", "--model", "m")


def _model_dir(path, files: dict[str, bytes]):
    from kvtier.engine.config import preset

    path.mkdir()
    (path / "config.json").write_text(json.dumps(preset("kimi-tiny").to_hf()))
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


@pytest.mark.parametrize("name, data, needle", [
    ("model.safetensors", b"\xff" * 100, "not a safetensors file"),
    ("model.safetensors", b"", "not a safetensors file"),
    ("model.safetensors.index.json", b"{bad", "not a safetensors index"),
])
def test_a_damaged_checkpoint_file_is_named(tmp_path, name, data, needle):
    model = _model_dir(tmp_path / "m", {name: data})
    r = run_kvtier("generate", "--prompt", "x", "--model", str(model))
    assert_one_line_error(r, 2, str(model / name), "damaged", needle, "download it again")
    assert "unexpected" not in r.stderr


@pytest.mark.parametrize("url, needles", [
    ("http://127.0.0.1:1/v1", ["has a path", "http://127.0.0.1:1", "without /v1"]),
    ("http://127.0.0.1", ["no port", "add"]),
])
def test_a_worker_url_says_what_is_wrong(url, needles):
    assert_one_line_error(run_kvtier("router", "--decode", url), 2, repr(url), *needles)


def test_a_toml_config_not_named_toml_gets_a_hint(tmp_path):
    conf = tmp_path / "kv.conf"
    conf.write_text('host_capacity = "64MiB"\n')
    r = run_kvtier(*NODE, "--config", str(conf), env=SECRET_ENV)
    assert_one_line_error(r, 2, "not valid JSON", "*.toml", "kv.toml")


def test_hit_ratio_names_every_policy_it_takes():
    r = run_kvtier("bench", "hit-ratio", "--sessions", "20", "--policy", "belady,bogus")
    assert_one_line_error(r, 2, "unknown policy 'bogus'", "lru", "'recommended'", "'belady'", "'all'")


@pytest.mark.parametrize("flag, limit, what", [
    ("--secret-file", MAX_KEY_FILE_BYTES, "secret file"),
    ("--salt-file", MAX_KEY_FILE_BYTES, "salt file"),
    ("--config", MAX_CONFIG_BYTES, "config file"),
])
def test_an_oversized_file_is_refused_unread(tmp_path, flag, limit, what):
    # a file one byte over the bound (not /dev/zero: should the bound go, this test must not
    # fill the machine's memory)
    big = tmp_path / "big"
    big.write_bytes(b"a" * (limit + 1))
    r = run_kvtier(*NODE, flag, str(big), env=SECRET_ENV)
    assert_one_line_error(r, 2, f"{what} {big}", f"{limit >> 10} KiB" if limit < 1 << 20 else "1 MiB")


def test_read_bounded_takes_a_file_of_exactly_the_bound(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    assert read_bounded(f, 10, "test file") == b"x" * 10
    with pytest.raises(ConfigError, match="test file .* larger than 9 B"):
        read_bounded(f, 9, "test file")


def test_an_address_space_limit_is_named_as_the_cause():
    from kvtier.tiers.memory import memory_available

    ask, limit = 7 << 29, 4 << 30     # python with torch maps about 1 GiB (3.6 GiB with CUDA's libraries)
    avail = memory_available()[0]
    if avail is not None and avail < ask:
        pytest.skip("this machine has less than 3.5 GiB available: the memory check would refuse first")
    # no GPU and one OpenMP thread: CUDA's address-space reservations and, on a 16-core GPU
    # machine, libgomp's thread stacks failed under this limit before kvtier's own allocation
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "generate", "--prompt", "x", "--host-cache", "3.5GiB"],
                       capture_output=True, text=True, timeout=300, env=env,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert_one_line_error(r, 2, "3.50 GiB asked for", "address-space limit", "ulimit -v", "4.00 GiB")
    assert "this machine has" not in r.stderr


@pytest.mark.parametrize("host", ["999.1.1.1", "no-such-host.invalid", "a..b"])
def test_a_host_that_cannot_be_listened_on_is_a_usage_error(host):
    # a..b was an "unexpected UnicodeError" (exit 1): the lookup refuses an empty label so
    r = run_kvtier(*NODE, "--listen", f"{host}:7700", env=SECRET_ENV)
    assert_one_line_error(r, 2, f"--listen '{host}:7700'", f"{host!r} is not an address", "0.0.0.0")
    r = run_kvtier("serve", "--host", host, "--port", "0")
    assert_one_line_error(r, 2, f"--host {host!r}", "not an address this machine can listen on")


def test_an_unwritable_plot_path_fails_before_the_replay():
    pytest.importorskip("matplotlib")
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    r = run_kvtier("bench", "hit-ratio", "--json", "--sessions", "20", "--plot", "/proc/kvtier-test.png")
    assert_one_line_error(r, 2, "--plot", "/proc/kvtier-test.png", "cannot be written")
    assert r.stdout == ""                    # no replay ran (--json would have printed rows)


def test_the_ucx_warning_names_every_interface():
    from kvtier.net.ucx import every_interface_warning

    assert "every interface" in every_interface_warning("127.0.0.1", 7799)
    assert "firewall" in every_interface_warning("127.0.0.1", 7799)
    assert every_interface_warning("0.0.0.0", 7799) is None
    assert every_interface_warning("::", 7799) is None


def test_a_ucx_node_warns_that_it_listens_on_every_interface():
    pytest.importorskip("ucxx", reason="ucxx is not installed: pip install 'kvtier[ucx]'")
    env = {**SECRET_ENV, "UCX_WARN_UNUSED_ENV_VARS": "n"}
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *NODE, "--transport", "ucx",
                          "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        banner = p.stdout.readline()         # the warning is logged before the banner
        assert "kvtier node: serving" in banner, (banner, p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "UCX listens on every interface" in err and "not only on 127.0.0.1" in err, err
    assert "Traceback" not in err, err
