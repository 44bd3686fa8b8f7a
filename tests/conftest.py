"""Shared fixtures: small layouts and stores, one torch thread, the real traces' folder."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.bench.common import child_env  # noqa: F401  (the tests' subprocesses import it from here)

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"




_config: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _config.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With KVTIER_EARLY_FAILURES=1 (bench/gpu_check.sh), each failure's last line on stderr
    as it happens (from the main process under xdist, which gets every worker's reports): a
    run cut off by a deadline (pytest says why only in its closing summary) still says why
    its tests failed."""
    if not (report.failed and os.environ.get("KVTIER_EARLY_FAILURES") and _config) \
            or hasattr(_config[0], "workerinput"):
        return
    last = (report.longreprtext.strip().splitlines() or ["?"])[-1]
    capture = _config[0].pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        sys.stderr.write(f"\nEARLY {report.nodeid} ({report.when}): {last[:400]}\n")
        sys.stderr.flush()


@pytest.fixture
def layout() -> kvtier.KVLayout:
    """A tiny MHA layout: 2 layers x K,V x 4 tokens x 2 heads x 8 dims x fp16 = 512 B/block."""
    return kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)


@pytest.fixture
def ns() -> kvtier.Namespace:
    return kvtier.Namespace(model="test-model", revision="r1")


def payload(keys: list[bytes], block_bytes: int) -> torch.Tensor:
    """Bytes derived from each key only, so any load can be checked exactly."""
    out = torch.empty(len(keys), block_bytes, dtype=torch.uint8)
    for i, k in enumerate(keys):
        row = torch.frombuffer(bytearray(k * (block_bytes // 16 + 1)), dtype=torch.uint8)
        out[i] = row[:block_bytes]
    return out


@pytest.fixture
def children():
    """Start Python child processes (each prints one line when ready); all are killed after the test."""
    procs: list[subprocess.Popen] = []

    def start(code: str, env: dict | None = None, stdin: bool = False) -> tuple[subprocess.Popen, str]:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                             stdin=subprocess.PIPE if stdin else None)
        procs.append(p)
        line = p.stdout.readline().strip()
        assert line, "the child process did not start"
        return p, line

    yield start
    for p in procs:
        p.kill()
        p.wait()


def run_kvtier(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `kvtier` command in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """The command failed with exit `code` and said so on one `kvtier: error:` line (no traceback)
    that contains each of `needles`."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvtier: error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
