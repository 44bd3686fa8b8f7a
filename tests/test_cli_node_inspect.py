"""`kvtier node` and `kvtier inspect` as a user runs them: every bad input is one short line
with a nonzero exit, a node reports peers that do not answer once (and when they are back),
and a damaged or corrupt disk tier is said so, with what to do."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest
import torch

import kvtier
from kvtier.errors import ConfigError
from kvtier.net.directory import check_redis_url
from kvtier.shard import parse_shard
from kvtier.tiers.disk_dir import read_directory
from tests.conftest import assert_one_line_error, payload, run_kvtier

SECRET = "cluster-secret-0123456789abcdef"
ENV = {**os.environ, "KVTIER_SECRET": SECRET}
NODE = ("node", "--listen", "127.0.0.1:0", "--layout", "llama3-8b", "--capacity", "64MiB", "--model", "m")
LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the checks behind the options -------------------------------------------------------
@pytest.mark.parametrize("text,parts", [("", {}), ("tp0/8", {"tp": (0, 8)}), ("pp3/4", {"pp": (3, 4)}),
                                        ("tp7/8,pp0/2", {"tp": (7, 8), "pp": (0, 2)}), ("tp0/1", {"tp": (0, 1)})])
def test_shard_syntax_accepted(text, parts):
    assert parse_shard(text) == parts


@pytest.mark.parametrize("text", ["garbage", "tp8/8", "tp0/0", "tp-1/8", "tp00/8", "TP0/8", "tp0/8,", "tp 0/8",
                                  "pp0/2,tp0/8", "tp0/8,tp1/8", "tp0", "0/8", "dp0/8"])
def test_shard_syntax_refused(text):
    with pytest.raises(ConfigError, match="shard"):
        parse_shard(text)


def test_redis_urls():
    assert check_redis_url("redis://10.0.0.9:6379") == "redis://10.0.0.9:6379"
    assert check_redis_url("redis://user:hunter2@h:1/3") == "redis://user@h:1/3"      # no password in logs
    assert check_redis_url("rediss://h") == "rediss://h"
    assert check_redis_url("unix:///run/redis.sock") == "unix:///run/redis.sock"
    for bad in ("garbage", "http://h:1", "redis://", "redis://h:abc", "redis://h:1/x", "unix://", "h:6379"):
        with pytest.raises(ConfigError, match="Redis URL"):
            check_redis_url(bad)


# -- kvtier node: bad input ----------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (("--directory", "garbage"), "redis://"),
    (("--directory", "redis://h:abc"), "malformed"),
    (("--lease", "-5"), "--lease"),
    (("--shard", "garbage"), "tp0/8"),
    (("--shard", "tp8/8"), "rank 8"),
    (("--peers", "10.0.0.2:7700,nohost"), "'nohost'"),
    (("--peers", ","), "empty entry"),                      # was silently no peers
    (("--peers", "10.0.0.2:7700,"), "empty entry"),
    (("--peers", "127.0.0.1:0"), "port 0"),
    (("--peers", "[::1]"), "[::1]:7700"),
    (("--listen", "[nohost]:7700"), "IPv6 address in brackets"),
    (("--advertise", "10.0.0.1:0", "--directory", "redis://127.0.0.1:1"), "port 0"),
    (("--listen", "0.0.0.0:7750", "--directory", "redis://127.0.0.1:1"), "--advertise HOST:PORT"),
    (("--listen", "[::]:7750", "--directory", "redis://127.0.0.1:1"), "--advertise HOST:PORT"),
    (("--listen", "localhost"), "--listen"),
    (("--advertise", "10.0.0.1:7700"), "--directory"),
    (("--lease", "5"), "--directory"),
    (("--peers", "127.0.0.1:1", "--directory", "redis://127.0.0.1:1"), "not both"),
    (("--layout", "gpt-5"), "kimi-k2"),
    (("--policy", "fastest"), "unknown policy"),
])
def test_node_bad_options_are_one_line(args, needle):
    r = run_kvtier(*NODE, *args, env=ENV, timeout=120)
    assert_one_line_error(r, 2, needle)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_tier_too_small_for_a_block_names_the_setting_as_given(tmp_path):
    """From a --config file it said only "tier 'host': capacity 5 B is smaller than one block",
    naming neither the setting nor the file (kvtier generate and serve name both)."""
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"host_capacity": "5B"}')
    r = run_kvtier("node", "--listen", "127.0.0.1:0", "--config", str(cfg), env=ENV, timeout=120)
    assert_one_line_error(r, 2, f"host_capacity 5 B in {cfg} is smaller than one KV block")
    r = run_kvtier("node", "--listen", "127.0.0.1:0", "--capacity", "5B", env=ENV, timeout=120)
    assert_one_line_error(r, 2, "--capacity 5 B is smaller than one KV block", "give --capacity at least")


def test_a_short_secret_says_how_short(tmp_path):
    short = tmp_path / "short.secret"
    short.write_bytes(b"12345")
    r = run_kvtier(*NODE, "--secret-file", str(short), env=ENV, timeout=120)
    assert_one_line_error(r, 2, "at least 16 bytes", f"{short} holds 5 bytes")
    r = run_kvtier(*NODE, env={k: v for k, v in ENV.items() if k != "KVTIER_SECRET"}, timeout=120)
    assert_one_line_error(r, 2, "no --secret-file or KVTIER_SECRET given")


def test_the_secret_from_the_environment_is_stripped_like_the_files(monkeypatch, tmp_path):
    """A trailing space or newline in KVTIER_SECRET made a node whose peers refused it."""
    from kvtier.node_cli import read_secret
    monkeypatch.setenv("KVTIER_SECRET", f" {SECRET} \n")
    assert read_secret(None) == SECRET.encode()
    (tmp_path / "secret").write_text(f"{SECRET}\n")
    assert read_secret(str(tmp_path / "secret")) == SECRET.encode()


def test_node_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = run_kvtier(*NODE[:1], "--listen", f"127.0.0.1:{port}", *NODE[3:], env=ENV, timeout=120)
    assert_one_line_error(r, 2, f"127.0.0.1:{port}", "in use")


def test_node_help_gives_each_default_and_the_presets():
    from kvtier.cli import build_parser
    from kvtier.presets import LAYOUT_PRESETS as PRESETS

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["node"]
    fmt = sub._get_formatter()
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in fmt._get_help_string(action), action.option_strings
    layout = next(a for a in sub._actions if a.dest == "layout")
    assert all(name in layout.help for name in PRESETS)


# -- kvtier node: peers that do not answer, and stopping ---------------------------------------
class Lines:
    """A process's stream, read on a thread, so a test can wait for a line."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in stream], daemon=True).start()

    def wait_for(self, text: str, secs: float = 30) -> bool:
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            if any(text in ln for ln in self.lines):
                return True
            time.sleep(0.05)
        return False


def start_node(*args: str) -> tuple[subprocess.Popen, Lines, Lines]:
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *NODE, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)
    return p, Lines(p.stdout), Lines(p.stderr)


def serve_then_stop(sig: int, *args: str) -> tuple[Lines, Lines]:
    """A node started with `args`, stopped by `sig` once it serves (it must exit 0): its output."""
    p, out, err = start_node(*args)
    try:
        assert out.wait_for("serving 'm'"), (out.lines, err.lines)
    finally:
        p.send_signal(sig)
        assert p.wait(timeout=30) == 0
    return out, err


def test_a_peer_down_at_start_is_reported_once_and_when_it_comes_up():
    port = free_port()
    peer = f"127.0.0.1:{port}"
    p, out, err = start_node("--peers", peer)
    try:
        assert out.wait_for("serving 'm'"), (out.lines, err.lines)
        assert err.wait_for(f"peer {peer} unreachable"), err.lines
        time.sleep(2)                       # retried with backoff meanwhile: still one line
        store = kvtier.Store(kvtier.preset_layout("llama3-8b", 16), [kvtier.HostTier(blocks=4)], kvtier.Namespace("m"))
        with kvtier.Node(store, peer, SECRET.encode()):
            assert err.wait_for(f"peer {peer} reachable again", secs=20), err.lines
        store.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    mentions = [ln for ln in err.lines if peer in ln]
    assert len(mentions) == 2, err.lines          # down once, back once
    assert "Traceback" not in "".join(err.lines)


def test_a_peer_with_another_secret_is_reported_as_refusing():
    port = free_port()
    store = kvtier.Store(kvtier.preset_layout("llama3-8b", 16), [kvtier.HostTier(blocks=4)], kvtier.Namespace("m"))
    with kvtier.Node(store, f"127.0.0.1:{port}", b"another-secret-0123456789abcdef"):
        p, out, err = start_node("--peers", f"127.0.0.1:{port}")
        try:
            assert err.wait_for("refusing requests"), (out.lines, err.lines)
            assert any("secret" in ln for ln in err.lines), err.lines
        finally:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
    store.close()


def test_ctrl_c_stops_a_node_cleanly(tmp_path):
    out, err = serve_then_stop(signal.SIGINT, "--disk", str(tmp_path / "kv"), "--disk-capacity", "64MiB")
    assert f"host 64.00 MiB, disk {tmp_path / 'kv'} 64.00 MiB" in out.lines[0], out.lines
    assert out.wait_for("stopped; served 0 requests"), out.lines
    assert "kvtier node: stopping (writing host blocks down to disk)" in "".join(out.lines), out.lines
    assert "Traceback" not in "".join(err.lines), err.lines
    assert read_directory(tmp_path / "kv")[0]["namespace"]["model"] == "m"     # the disk tier closed cleanly


def put_four_blocks(out: Lines, err: Lines) -> tuple[kvtier.KVLayout, kvtier.BlockKeys]:
    """Once the node whose output is `out` serves, put 4 llama3-8b blocks to it as a peer."""
    from kvtier.net.client import PeerClient
    assert out.wait_for("serving 'm'"), (out.lines, err.lines)
    address = out.lines[0].rsplit(" on ", 1)[1].strip()
    layout = kvtier.preset_layout("llama3-8b", 16)
    local = kvtier.Store(layout, [kvtier.HostTier(blocks=1)], kvtier.Namespace("m"))
    keys = local.keys(list(range(4 * 16)))
    with PeerClient.for_store(local, address, SECRET.encode(), timeout=10) as client:
        assert client.put(keys, payload(keys, layout.block_bytes)) == 4
    local.close()
    return layout, keys


def test_a_node_whose_terminal_closed_writes_its_host_blocks_down(tmp_path):
    """SIGHUP (the terminal or ssh session of a node started by hand went away) killed the
    node at once: every block held only in host memory was lost. It stops cleanly now, as on
    SIGTERM, and the blocks peers put are on disk for the next start."""
    p, out, err = start_node("--disk", str(tmp_path / "kv"), "--disk-capacity", "64MiB")
    try:
        put_four_blocks(out, err)
    finally:
        p.send_signal(signal.SIGHUP)
        assert p.wait(timeout=30) == 0
    assert out.wait_for("stopped; served 1 requests"), out.lines
    assert "Traceback" not in "".join(err.lines), err.lines
    assert len(read_directory(tmp_path / "kv")[1]) == 4       # written down at exit


def test_a_node_killed_outright_keeps_what_its_periodic_flush_wrote(tmp_path):
    """SIGKILL (the OOM killer) gives a node no chance to write its host blocks down: a
    helper's run kept none of 300 acknowledged requests whole. --flush-every writes them down
    as it serves."""
    p, out, err = start_node("--disk", str(tmp_path / "kv"), "--disk-capacity", "64MiB", "--flush-every", "0.5")
    try:
        layout, keys = put_four_blocks(out, err)
        deadline = time.monotonic() + 30
        while len(read_directory(tmp_path / "kv")[1]) < 4:
            assert time.monotonic() < deadline, "the blocks were not flushed"
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait(timeout=30)
    store = kvtier.Store(layout, [kvtier.HostTier(blocks=8), kvtier.DiskTier(tmp_path / "kv")], kvtier.Namespace("m"))
    out_ = torch.empty(4, layout.block_bytes, dtype=torch.uint8)
    assert store.get(store.keys(list(range(4 * 16))), out_).loaded == 4
    assert torch.equal(out_, payload(keys, layout.block_bytes))
    store.close()


def test_the_banner_and_inspect_give_a_disk_tier_the_same_size(tmp_path):
    """kimi-k2's blocks (1,124,352 bytes) are not 4 KiB multiples: the banner counted the
    tier's aligned slots (127.83 MiB) and inspect its blocks' bytes (127.60 MiB)."""
    out, _err = serve_then_stop(signal.SIGTERM, "--layout", "kimi-k2", "--disk", str(tmp_path / "kv"),
                                "--disk-capacity", "128MiB")
    banner = re.search(rf"disk {re.escape(str(tmp_path / 'kv'))} ([\d.]+ MiB)", out.lines[0])
    r = run_kvtier("inspect", str(tmp_path / "kv"))
    assert r.returncode == 0, r.stderr
    shown = re.search(r"blocks +0 of \d+ \(0 B of ([\d.]+ MiB)\)", r.stdout)
    assert banner and shown and banner[1] == shown[1] == "127.60 MiB", (out.lines[0], r.stdout)


def test_a_node_with_its_disk_in_a_config_file_shows_it_and_writes_it_down(tmp_path):
    """With disk_path in --config rather than --disk, the banner showed no size and the stop
    line did not say it writes host blocks down to disk."""
    (tmp_path / "node.toml").write_text(f'disk_path = "{tmp_path / "kv"}"\ndisk_capacity = "32MiB"\n')
    out, err = serve_then_stop(signal.SIGTERM, "--config", str(tmp_path / "node.toml"))
    assert f"disk {tmp_path / 'kv'} 32.00 MiB" in out.lines[0], out.lines
    assert out.wait_for("stopped;"), out.lines
    assert "kvtier node: stopping (writing host blocks down to disk)" in "".join(out.lines), out.lines


# -- kvtier inspect ----------------------------------------------------------------------------
@pytest.fixture
def tier(tmp_path) -> Path:
    """A disk tier directory holding 4 blocks."""
    path = tmp_path / "kv"
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(path, blocks=16)], kvtier.Namespace("m"),
                         write_through=True)
    keys = store.keys(list(range(16)))
    store.put(keys, payload(keys, LAYOUT.block_bytes))
    store.close()
    return path


def damage_index(path: Path, page: int) -> None:
    with open(path / "index.lmdb" / "data.mdb", "r+b") as f:
        f.seek(page * 4096)
        f.write(os.urandom(2 * 4096))


def blocks_root(path: Path) -> int:
    """The page number of the root of the index's `blocks` database: a data page read only
    when the records are (its MDB_db record in the main database ends with md_root)."""
    env = lmdb.open(str(path / "index.lmdb"), readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin() as txn:
            return struct.unpack_from("<Q", txn.get(b"blocks"), 40)[0]
    finally:
        env.close()


def open_store(path: Path) -> kvtier.Store:
    return kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(path, blocks=16)], kvtier.Namespace("m"))


def test_inspect_paths_that_are_no_disk_tier(tmp_path):
    assert_one_line_error(run_kvtier("inspect", str(tmp_path / "absent")), 2, "does not exist")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_kvtier("inspect", str(tmp_path / "file")), 2, "not a disk tier directory")
    assert_one_line_error(run_kvtier("inspect", str(tmp_path)), 2, "no kvtier disk tier")


def test_inspect_of_the_folder_above_tiers_names_them(tier, tmp_path):
    """kvtier serve --disk and the vLLM connector make a tier per namespace under the folder
    the user gave: inspecting that folder names the tiers in it."""
    assert tier.parent == tmp_path
    assert_one_line_error(run_kvtier("inspect", str(tmp_path)), 2, "holds no disk tier itself, but 1 in its subfolders",
                          f"kvtier inspect {tier}")


def test_inspect_and_a_store_name_what_is_wrong_with_the_directory(tier, tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "index.lmdb").write_text("x")
    assert_one_line_error(run_kvtier("inspect", str(tmp_path / "odd")), 2, "index.lmdb is a file")
    (tier / "slab.bin").unlink()
    (tier / "slab.bin").mkdir()
    assert_one_line_error(run_kvtier("inspect", "--verify", str(tier)), 1, "slab.bin", "not a regular file")
    (tier / "slab.bin").rmdir()
    os.mkfifo(tier / "slab.bin")                   # opening a FIFO to read waits for a writer: not done
    assert_one_line_error(run_kvtier("inspect", "--verify", str(tier), timeout=60), 1, "not a regular file")
    (tmp_path / "file").write_text("x")
    with pytest.raises(kvtier.ConfigError, match="is a file, not a directory"):
        open_store(tmp_path / "file")


def test_inspect_a_damaged_index_header_says_a_store_sets_it_aside(tier):
    damage_index(tier, 0)                   # both meta pages: LMDB refuses the file
    assert_one_line_error(run_kvtier("inspect", str(tier)), 1, "damaged", "moves it aside", "starts the tier empty")
    store = open_store(tier)                # ... and that is what a store does
    assert store.stats().recovered_blocks == 0
    store.close()
    assert [p.name for p in tier.iterdir() if p.name.startswith("index.lmdb.damaged-")]
    r = run_kvtier("inspect", str(tier))
    assert r.returncode == 0 and "blocks     0 of 16" in r.stdout, r.stderr


@pytest.mark.parametrize("keep", [8192, 12288, 20000])
def test_an_index_cut_short_is_damage_not_a_crash(tier, keep):
    """LMDB maps its file: a page past the end of a cut file is a SIGBUS (the process dies with
    no message) unless the file is first made as long as its newest transaction says."""
    os.truncate(tier / "index.lmdb" / "data.mdb", keep)
    assert_one_line_error(run_kvtier("inspect", str(tier)), 1, "damaged", "cut short", "moves it aside")
    store = open_store(tier)                # a store sets it aside and starts empty
    assert store.stats().recovered_blocks == 0
    store.close()
    assert [p.name for p in tier.iterdir() if p.name.startswith("index.lmdb.damaged-")]
    assert run_kvtier("inspect", str(tier)).returncode == 0


def test_an_index_lmdb_left_short_is_read_whole(tier):
    """LMDB itself may end its file before the last page it counts: pages taken and freed in
    one transaction are never written. Such an index is healthy: inspect reads it, and a
    store keeps every block (it rewrites the index compact)."""
    import lmdb

    from kvtier.tiers.lmdb_check import shortfall

    env = lmdb.open(str(tier / "index.lmdb"), map_size=1 << 30, max_dbs=4, subdir=True)
    scratch = env.open_db(b"scratch")
    with env.begin(write=True, db=scratch) as txn:        # free pages to reuse
        for i in range(2000):
            txn.put(b"k%06d" % i, b"v" * 100)
    for j in range(4):
        with env.begin(write=True, db=scratch) as txn:
            for i in range(j * 500, j * 500 + 500):
                txn.delete(b"k%06d" % i)
    with env.begin(write=True, db=scratch) as txn:        # new pages at the end, freed unwritten
        txn.put(b"small", b"s")
        txn.put(b"big", b"y" * 400_000)
        txn.delete(b"big")
    env.close()
    assert shortfall(tier / "index.lmdb") is not None
    r = run_kvtier("inspect", "--verify", str(tier))
    assert r.returncode == 0 and "blocks     4 of 16" in r.stdout and "4 good, 0 corrupt" in r.stdout, r.stderr
    store = open_store(tier)
    assert store.stats().recovered_blocks == 4
    store.close()
    assert shortfall(tier / "index.lmdb") is None
    assert not [p.name for p in tier.iterdir() if p.name.startswith("index.lmdb.")]     # nothing set aside


def test_a_damaged_index_page_is_set_aside_by_a_store_as_inspect_says(tier):
    """A damaged data page is found only while reading: a store raised lmdb's BadTxnError
    ("Transaction must abort"; `kvtier node`: "unexpected BadTxnError ... please report
    it") and would not open until someone moved the index by hand. A cache may forget: it
    keeps what it can still read (here nothing: the page was the only one of the records),
    sets the damaged index aside, and inspect says so."""
    damage_index(tier, blocks_root(tier))   # a data page: found only while reading
    r = run_kvtier("inspect", str(tier))
    assert_one_line_error(r, 1, "damaged", "opening a store on", "rebuilds it from the 0 records still readable",
                          "moves the damaged one aside")
    store = open_store(tier)
    assert store.stats().recovered_blocks == 0
    keys = store.keys(list(range(16)))
    store.put(keys, payload(keys, LAYOUT.block_bytes))        # the tier works
    store.close()
    assert [p.name for p in tier.iterdir() if p.name.startswith("index.lmdb.damaged-")]
    r = run_kvtier("inspect", "--verify", str(tier))
    assert r.returncode == 0 and "4 good, 0 corrupt" in r.stdout, r.stderr


def test_a_meta_record_that_does_not_decode_is_damage(tier):
    """A store raised msgpack's ExtraData; now it sets the index aside, and inspect says so."""
    import lmdb
    env = lmdb.open(str(tier / "index.lmdb"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"meta", b"\xc1garbage")
    env.close()
    assert_one_line_error(run_kvtier("inspect", str(tier)), 1, "damaged meta record", "moves the index aside")
    store = open_store(tier)
    assert store.stats().recovered_blocks == 0
    store.close()
    assert [p.name for p in tier.iterdir() if p.name.startswith("index.lmdb.damaged-")]


def test_inspect_reports_records_that_do_not_decode_and_a_store_drops_them(tier, caplog):
    """One undecodable record made inspect fail as a whole ("holds a damaged record ... move the
    index aside"), though its report has a line for damaged records and a store drops just
    that record (with a warning that said such records "point past the slab")."""
    import lmdb
    env = lmdb.open(str(tier / "index.lmdb"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        first, second = [bytes(k) for k, _ in txn.cursor()][:2]
        txn.put(first, b"\xc1garbage")
        txn.put(second, b"\x92\x01\x02")              # a list of 2, not a record
    env.close()
    r = run_kvtier("inspect", str(tier), "--verify")
    assert r.returncode == 0, r.stderr
    assert "blocks     2 of 16" in r.stdout and "damaged    2 records" in r.stdout and "2 good, 0 corrupt" in r.stdout
    assert json.loads(run_kvtier("inspect", str(tier), "--json").stdout)["damaged_records"] == 2
    with caplog.at_level("WARNING", logger="kvtier.disk"):
        store = open_store(tier)
    assert store.stats().recovered_blocks == 2
    store.close()
    assert "dropped 2 damaged records" in caplog.text and "past the slab" not in caplog.text, caplog.text


def four_hundred_blocks(tmp_path: Path) -> Path:
    """A closed disk tier holding 400 blocks: its `blocks` tree is a branch over leaves."""
    path = tmp_path / "kv"
    store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(path, blocks=512)], kvtier.Namespace("m"),
                         write_through=True)
    for c in range(100):
        keys = store.keys(list(range(c * 1000, c * 1000 + 16)))
        store.put(keys, payload(keys, LAYOUT.block_bytes))
    store.close()
    return path


def first_leaf(path: Path, raw: bytes, child: int = 0) -> int:
    """The page number of the first leaf under the root's `child`-th child, in the `blocks`
    tree of data.mdb's bytes `raw`."""
    page = blocks_root(path)
    while not struct.unpack_from("<H", raw, page * 4096 + 10)[0] & 0x02:
        node = page * 4096 + struct.unpack_from("<H", raw, page * 4096 + 16 + 2 * child)[0]
        lo, hi, top = struct.unpack_from("<HHH", raw, node)                    # a branch node's child
        page = lo | hi << 16 | top << 32
        child = 0
    return page


@pytest.mark.parametrize("which", ["leaf", "branch"])
def test_a_zeroed_page_in_the_index_is_damage_not_an_abort(tmp_path, which):
    """A zeroed page in the tree of records (a lost write, a bad sector): LMDB aborted the
    process (SIGABRT, `Assertion 'IS_LEAF(mp)' failed`) while a store read the records, at
    every open, and in `kvtier inspect` (session-25 trial, 16 of 40 zeroed pages). The pages
    are checked before LMDB walks them: inspect says the index is damaged, and a store
    rebuilds it from the records it can still read (none when the page lost was the tree's
    root), keeping the damaged one aside."""
    path = four_hundred_blocks(tmp_path)
    data = path / "index.lmdb" / "data.mdb"
    raw = data.read_bytes()
    # (a leaf after the first: LMDB itself reported the first as damaged, and aborted on a
    # later one as a cursor stepped onto it)
    page = first_leaf(path, raw, child=1) if which == "leaf" else blocks_root(path)
    with open(data, "r+b") as f:
        f.seek(page * 4096)
        f.write(bytes(4096))
    on_page = (struct.unpack_from("<H", raw, page * 4096 + 12)[0] - 16) // 2   # the records it held
    kept = 400 - on_page if which == "leaf" else 0
    r = run_kvtier("inspect", str(path))
    assert_one_line_error(r, 1, "damaged", f"page {page} is not the {which} page",
                          f"rebuilds it from the {kept} records still readable", "moves the damaged one aside")
    code = ("import sys, kvtier; from pathlib import Path; from tests.test_cli_node_inspect import LAYOUT; "
            "s = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(Path(sys.argv[1]))], "
            "kvtier.Namespace('m')); print(s.stats().recovered_blocks); s.close()")
    for attempt in range(2):
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1])
        assert r.returncode == 0, (r.returncode, r.stderr[-1500:])
        assert r.stdout.split() == [str(kept)]
        assert ("rebuilt from its readable pages" in r.stderr) == (attempt == 0), r.stderr
    assert len(list(path.glob("index.lmdb.damaged-*"))) == 1
    r = run_kvtier("inspect", str(path), "--verify")
    assert r.returncode == 0 and f"{kept} good, 0 corrupt" in r.stdout, r.stdout


def test_damage_lmdb_finds_while_reading_costs_only_the_records_it_hides(tmp_path, caplog, monkeypatch):
    """Damage LMDB reports while the records are read (MDB_CORRUPTED), which the page check
    before it missed (simulated: the check is turned off, the first leaf zeroed): the whole
    index was set aside (400 blocks lost for one page). It is rebuilt from the records of
    the readable pages."""
    import kvtier.tiers.disk as disk

    path = four_hundred_blocks(tmp_path)
    data = path / "index.lmdb" / "data.mdb"
    raw = data.read_bytes()
    page = first_leaf(path, raw)
    on_page = (struct.unpack_from("<H", raw, page * 4096 + 12)[0] - 16) // 2
    with open(data, "r+b") as f:
        f.seek(page * 4096)
        f.write(bytes(4096))
    monkeypatch.setattr(disk, "tree_damage", lambda *a, **k: None)
    with caplog.at_level("WARNING", logger="kvtier.disk"):
        store = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(path)], kvtier.Namespace("m"))
    assert store.stats().recovered_blocks == 400 - on_page
    store.close()
    assert "MDB_CORRUPTED" in caplog.text and f"rebuilt from its readable pages: kept {400 - on_page}" in caplog.text


def test_a_record_with_a_damaged_size_is_dropped_without_damaging_the_index(tmp_path):
    """A flipped bit in a record's size (its node header in a leaf page): the record reads
    as undecodable and is dropped. Dropping it in place let LMDB trust the damaged size: the
    next open found the page damaged and set the whole index aside (400 blocks lost for one
    record; in a session-25 trial every later open died with SIGBUS). The index is rewritten
    without it instead."""
    path = four_hundred_blocks(tmp_path)
    data = path / "index.lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    page = first_leaf(path, raw)
    node = page * 4096 + struct.unpack_from("<H", raw, page * 4096 + 16 + 2 * 5)[0]   # its 6th record
    size = struct.unpack_from("<H", raw, node)[0]                                    # mn_lo: its size
    struct.pack_into("<H", raw, node, size ^ 0x80)
    data.write_bytes(raw)
    code = ("import sys, kvtier; from pathlib import Path; from tests.test_cli_node_inspect import LAYOUT; "
            "from tests.conftest import payload; "
            "s = kvtier.Store(LAYOUT, [kvtier.HostTier(blocks=8), kvtier.DiskTier(Path(sys.argv[1]))], "
            "kvtier.Namespace('m')); print(s.stats().recovered_blocks); "
            "k = s.keys(list(range(10**6, 10**6 + 16))); s.put(k, payload(k, LAYOUT.block_bytes)); s.close()")
    recovered = []
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1])
        assert r.returncode == 0 and "set aside" not in r.stderr and "damaged (" not in r.stderr, r.stderr[-1500:]
        recovered.append(int(r.stdout))
    assert recovered == [399, 403, 403]
    r = run_kvtier("inspect", str(path), "--verify")
    assert r.returncode == 0 and "blocks     403 of 512" in r.stdout and "403 good, 0 corrupt" in r.stdout, r.stdout


def test_inspect_an_lmdb_kvtier_did_not_write_says_so(tmp_path):
    """It said the index was damaged and to move it aside; a store refuses it as another
    program's database, and so does inspect now (exit 2: not a disk tier)."""
    import lmdb
    env = lmdb.open(str(tmp_path / "index.lmdb"), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    assert_one_line_error(run_kvtier("inspect", str(tmp_path)), 2, "an LMDB database kvtier did not write")
    with pytest.raises(kvtier.ConfigError, match="an LMDB database kvtier did not write"):
        open_store(tmp_path)


def test_inspect_says_when_the_slab_or_the_index_data_is_gone(tier, tmp_path):
    """Without slab.bin the report said all was well; without index.lmdb/data.mdb it said the
    index was damaged and a store could not open it (a store opens it, and starts empty)."""
    import shutil
    other = tmp_path / "copy"
    shutil.copytree(tier, other)
    (tier / "slab.bin").unlink()
    r = run_kvtier("inspect", str(tier))
    assert r.returncode == 0 and "slab.bin is missing or empty: none of these blocks can be read" in r.stdout
    (other / "index.lmdb" / "data.mdb").unlink()
    assert_one_line_error(run_kvtier("inspect", str(other)), 1, "holds no data.mdb", "starts the tier empty")


def test_an_empty_index_file_is_set_aside_with_a_warning_and_inspect_says_so(tier, caplog):
    """An empty data.mdb: inspect called it damaged (LMDB's "Bad file descriptor") and said a
    store could not open it; a store opened it as a new index and started the tier empty
    without a word, every block in the slab unreachable."""
    os.truncate(tier / "index.lmdb" / "data.mdb", 0)
    assert_one_line_error(run_kvtier("inspect", str(tier)), 1, "is empty (data.mdb is 0 bytes",
                          "moves it aside (index.lmdb.damaged-TIME) and starts the tier empty")
    with caplog.at_level("WARNING", logger="kvtier.disk"):
        store = open_store(tier)
    assert "index damaged (its data.mdb is empty (0 bytes)); moved to index.lmdb.damaged-" in caplog.text
    assert store.stats().recovered_blocks == 0 and any(tier.glob("index.lmdb.damaged-*"))
    store.close()


def test_verify_does_not_count_a_block_whose_record_changed_meanwhile(tier):
    """A live store reuses slots: the new bytes land before the old block's record goes, so
    a snapshot of the records can name bytes no longer there. A failure counts only if the
    record read again still names those bytes (a live engine's evictions read as corruption)."""
    from kvtier.inspect import verify
    meta, records = read_directory(tier)
    key, rec = records[0]
    stale = [(key, [rec[0], rec[1] ^ 1, *rec[2:]])] + records[1:]    # what a snapshot taken mid-write holds
    assert verify(str(tier), meta, stale, show=False) == 0
    gone = [(b"\0" * 16, [rec[0], rec[1] ^ 1, *rec[2:]])] + records   # a block evicted since
    assert verify(str(tier), meta, gone, show=False) == 0


def test_inspect_verify_fails_on_corrupt_blocks_and_still_reports(tier):
    r = run_kvtier("inspect", str(tier), "--verify")
    assert r.returncode == 0 and "4 good, 0 corrupt" in r.stdout and r.stderr == "", r.stderr
    meta, records = read_directory(tier)
    with open(tier / "slab.bin", "r+b") as f:                 # damage one stored block
        f.seek(records[0][1][0] * meta["slot_bytes"] + 100)
        f.write(b"\xff" * 8)
    r = run_kvtier("inspect", str(tier), "--verify")
    assert_one_line_error(r, 1, "1 of 4 blocks", "failed verification")
    assert "3 good, 1 corrupt" in r.stdout
    r = run_kvtier("inspect", str(tier), "--verify", "--json")
    assert_one_line_error(r, 1, "1 of 4 blocks")
    assert json.loads(r.stdout)["corrupt_blocks"] == 1
    (tier / "slab.bin").unlink()
    assert_one_line_error(run_kvtier("inspect", str(tier), "--verify"), 1, "4 of 4", "slab.bin is missing")


def test_inspect_shows_progress_while_it_reads_the_index(tier, monkeypatch, capsys):
    """Reading a large index (2M records: about 10 s) showed nothing on a terminal; --json
    shows nothing (progress is for a person watching)."""
    import argparse
    from contextlib import contextmanager

    import kvtier.inspect
    import kvtier.progress
    shown = []

    @contextmanager
    def recording(description, total=None, enabled=True):
        if enabled:
            shown.append(description)
        yield kvtier.progress.Progress()
    monkeypatch.setattr(kvtier.progress, "progress", recording)
    assert kvtier.inspect.run(argparse.Namespace(path=str(tier), verify=False, json=False)) == 0
    assert shown == [f"reading the index of {tier}"]
    shown.clear()
    assert kvtier.inspect.run(argparse.Namespace(path=str(tier), verify=True, json=True)) == 0
    assert shown == []
    capsys.readouterr()


def test_a_node_shows_progress_while_its_store_opens(tmp_path):
    """Opening a store that adopts a large disk tier took 25-33 s (2M blocks) with nothing on
    the terminal; a spinner says what it is doing (on a terminal only)."""
    import os
    import pty
    import select
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", *NODE, "--disk", str(tmp_path / "kv"),
                          "--disk-capacity", "64MiB"], stdout=subprocess.PIPE, stderr=slave, text=True, env=ENV)
    os.close(slave)
    out = Lines(p.stdout)
    seen = b""
    try:
        assert out.wait_for("serving 'm'"), out.lines
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        os.close(master)
    assert b"opening the store, adopting the blocks in /" in seen, seen[-2000:]   # (cut to the terminal's width)
