"""Whatever stops `kvtier bench serve` / `bench disagg` (Ctrl-C, SIGTERM, an error, even SIGKILL),
no server it started is left running (nor bench/engine_vs_vllm.py's engines and folder);
`bench engine --compare-vllm` refuses a python without vllm on one line, before anything runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import assert_one_line_error, child_env

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")

HANG = 120          # seconds: a bench that has not exited by then hangs
MARK = "KVTIER_TEST_BENCH_CLEANUP"


def _marked(mark: str) -> dict[int, str]:
    """Live (not zombie) processes whose environment carries `mark`: the bench and every
    process it started, whoever their parent is now; pid -> command line."""
    found = {}
    needle = f"{MARK}={mark}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{d}/environ").read_bytes().split(b"\0"):
                continue
            if Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:         # gone meanwhile, or not ours
            continue
    return found


def _servers(mark: str, bench: int) -> dict[int, str]:
    # Not the bench, nor a child it forked that has not exec'd yet (it still shows the bench's
    # command line: one forked while importing, before any signal handler, was taken for a
    # server and sent the test's SIGTERM: the bench died of it, -15, a flaky failure)
    marked = _marked(mark)
    own = marked.get(bench)
    return {pid: cmd for pid, cmd in marked.items()
            if pid != bench and cmd != own and "kvtier.cli" in cmd and (" serve " in cmd or " router " in cmd)}


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    mark = uuid.uuid4().hex
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "bench", *args], cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(**{MARK: mark}))
    return p, mark


def _wait_for_server(p: subprocess.Popen, mark: str) -> None:
    deadline = time.monotonic() + HANG
    while not _servers(mark, p.pid):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the bench started no server"
        time.sleep(0.05)


def _none_left(mark: str, bench: int) -> dict[int, str]:
    """The bench's servers still running after a while to exit (empty: none)."""
    deadline = time.monotonic() + 30
    while (left := _servers(mark, bench)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_all(mark: str) -> None:
    for pid in _marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


SMALL = {"serve": ["serve", "--modes", "none", "--sessions", "2", "--max-requests", "2", "--max-tokens", "2"],
         "disagg": ["disagg", "--setups", "pd", "--sessions", "2", "--max-requests", "2", "--max-tokens", "2"]}


@pytest.mark.parametrize("bench,sig", [("serve", signal.SIGINT), ("serve", signal.SIGTERM), ("disagg", signal.SIGINT)],
                         ids=["serve-SIGINT", "serve-SIGTERM", "disagg-SIGINT"])
def test_a_signal_stops_the_bench_and_its_servers(tmp_path, bench, sig):
    p, mark = _start(tmp_path, *SMALL[bench])
    try:
        _wait_for_server(p, mark)
        p.send_signal(sig)
        out, err = p.communicate(timeout=HANG)
        assert p.returncode == 130, (p.returncode, err)
        assert err.strip().splitlines()[-1] == "kvtier: interrupted", err
        assert "Traceback" not in err, err
        assert _none_left(mark, p.pid) == {}
    finally:
        p.kill()
        p.communicate()
        _kill_all(mark)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_servers_die_with_a_killed_bench(tmp_path):
    p, mark = _start(tmp_path, *SMALL["serve"])
    try:
        _wait_for_server(p, mark)
        p.kill()
        p.communicate(timeout=HANG)
        assert _none_left(mark, p.pid) == {}
    finally:
        _kill_all(mark)


# -- the shared helper, with dummy children ----------------------------------------------------------
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
STUBBORN = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('ready', flush=True); time.sleep(600)"]


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def test_children_are_stopped_when_the_block_fails():
    from kvtier.bench.children import Children

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError):
        with Children() as children:
            a, b = children.start(SLEEP), children.start(SLEEP)
            assert _alive(a) and _alive(b)
            raise RuntimeError("start-up failed")
    assert not _alive(a) and not _alive(b) and children.procs == []
    assert signal.getsignal(signal.SIGTERM) is before      # its SIGTERM handler is gone with it


def test_a_child_that_ignores_sigterm_is_killed():
    from kvtier.bench.children import Children

    with Children(grace=0.5) as children:
        p = children.start(STUBBORN, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"                 # its SIGTERM handler is set
        q = children.start(SLEEP)
        assert children.stop([p]) == -signal.SIGKILL
        assert _alive(q) and children.procs == [q]              # stop(procs) stops those only
    assert not _alive(q)


def test_sigterm_is_an_interrupt_inside_the_block():
    from kvtier.bench.children import Children

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler here: Children leaves it alone")
    with pytest.raises(KeyboardInterrupt):
        with Children() as children:
            p = children.start(SLEEP)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL    # else the kill below ends pytest
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)                                      # the handler raises at once
    assert not _alive(p)


# -- bench engine --compare-vllm ---------------------------------------------------------------------
def _fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_compare_vllm_refuses_a_python_without_vllm_at_once(tmp_path):
    # this interpreter without site-packages or PYTHONPATH: a python that has no vllm, wherever the test runs
    fake = _fake_python(tmp_path, f'exec "{sys.executable}" -I -S "$@"')
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "engine", "--compare-vllm",
                        "--vllm-python", fake], capture_output=True, text=True, timeout=HANG, env=child_env())
    assert_one_line_error(r, 2, f"--vllm-python {fake}", "cannot import vllm", "docs/vllm.md")
    assert r.stdout == "" and "round 1" not in r.stderr            # nothing ran


def test_a_failed_engine_child_is_one_line_with_its_last_words(tmp_path):
    import importlib.util

    from kvtier.errors import KvtierError

    script = Path(__file__).resolve().parents[1] / "bench" / "engine_vs_vllm.py"
    spec = importlib.util.spec_from_file_location("engine_vs_vllm_test", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fake = _fake_python(tmp_path, "echo 'Traceback (most recent call last):' >&2; echo '  File x' >&2; "
                                  "echo 'RuntimeError: no CPU backend' >&2; exit 1")
    from kvtier.bench.children import Children
    with pytest.raises(KvtierError) as e, Children() as children:
        mod._spawn(children, fake, "vllm", {}, tmp_path)
    msg = str(e.value)
    assert "RuntimeError: no CPU backend" in msg and "exit status 1" in msg
    assert "Traceback" not in msg and "\n" not in msg


def test_sigterm_stops_the_engine_comparison_its_engines_and_its_folder(tmp_path):
    """bench/engine_vs_vllm.py run by hand and sent SIGTERM died at once: its engine process
    ran on and its temporary folder (the model it wrote) stayed."""
    mark = uuid.uuid4().hex
    script = Path(__file__).resolve().parents[1] / "bench" / "engine_vs_vllm.py"
    p = subprocess.Popen([sys.executable, str(script), "--only", "kvtier", "--rounds", "3"], cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=child_env(**{MARK: mark, "TMPDIR": str(tmp_path)}))
    try:
        deadline = time.monotonic() + HANG
        while not any("--child" in cmd for cmd in _marked(mark).values()):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no engine started"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=HANG)
        assert p.returncode == 130 and err.strip().splitlines()[-1].endswith("interrupted"), (p.returncode, err)
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 30
        while (left := {k: c for k, c in _marked(mark).items() if k != p.pid}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == {}
        assert list(tmp_path.glob("kvtier-engine-vs-vllm-*")) == []
    finally:
        p.kill()
        p.communicate()
        _kill_all(mark)
