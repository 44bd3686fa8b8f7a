"""Nothing written is lost at exit: a store nobody closes still writes its memory-only
(write-back) blocks to its disk tier when the interpreter exits, whatever the disk tier's
I/O threads did before (Python shuts thread pools down before atexit handlers run)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvtier
from tests.conftest import REPO, payload

L = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=8, dtype=torch.float16)


def open_store(path, host: int = 16) -> kvtier.Store:
    return kvtier.Store(L, [kvtier.HostTier(blocks=host), kvtier.DiskTier(path, blocks=64)],
                        kvtier.Namespace("exit-test", "r1"))


def chain(store: kvtier.Store, first: int, blocks: int = 4) -> kvtier.BlockKeys:
    return store.keys([first] * (blocks * L.block_tokens))


def check(store: kvtier.Store, keys) -> None:
    """The blocks are cached and byte-exact (a block's bytes are derived from its key)."""
    out = torch.zeros(len(keys), L.block_bytes, dtype=torch.uint8)
    assert store.lookup(keys).blocks == len(keys), store.lookup(keys).by_tier()
    assert store.get(keys, out).loaded == len(keys)
    assert torch.equal(out, payload(keys, L.block_bytes)), "wrong bytes"


def run(path: Path, code: str) -> subprocess.CompletedProcess:
    """A second process over the store at `path` (this module's helpers imported); fails the
    test if it exits nonzero."""
    prelude = "import sys, torch, kvtier\nfrom tests.conftest import payload\nfrom tests.test_exit_flush import *\n"
    r = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), str(path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def first_process(path: Path) -> None:
    """Process 1 (this one): chain 1 is written and the store closed."""
    with open_store(path) as s:
        a = chain(s, 1)
        s.put(a, payload(a, L.block_bytes))


@pytest.mark.parametrize("read_first", [True, False], ids=["after-a-disk-read", "no-disk-io"])
def test_blocks_of_a_store_never_closed_are_on_disk_for_the_next_process(tmp_path, read_first):
    first_process(tmp_path / "kv")
    r = run(tmp_path / "kv", f"""
        s = open_store(sys.argv[1])
        a, b = chain(s, 1), chain(s, 2)
        assert s.lookup(a).by_tier() == {{"host": 0, "disk": 4}}
        if {read_first}:
            check(s, a)        # a disk read: the disk tier's I/O threads have run
        s.put(b, payload(b, L.block_bytes))
        assert s.lookup(b).by_tier()["host"] == 4   # in memory only: written back at exit
        t = s.put(chain(s, 3), payload(chain(s, 3), L.block_bytes), blocking=False)   # never waited for
        # no close(): the interpreter exits here
    """)
    assert "Traceback" not in r.stderr and "Exception" not in r.stderr, r.stderr
    with open_store(tmp_path / "kv") as s:          # process 3: this one again
        assert s.stats().recovered_blocks == 12
        for first in (1, 2, 3):
            check(s, chain(s, first))


def test_blocks_demoted_and_written_back_survive_an_exit_without_close(tmp_path):
    """A host tier of 4 blocks: each put demotes the previous chains to disk (write-back),
    and the last chain is in memory only when the process exits."""
    first_process(tmp_path / "kv")
    run(tmp_path / "kv", """
        s = open_store(sys.argv[1], host=4)
        check(s, chain(s, 1))
        for first in range(2, 7):
            k = chain(s, first)
            s.put(k, payload(k, L.block_bytes))
        assert s.stats().tier("host").used_blocks == 4 and s.stats().tier("disk").demoted_in > 0
    """)
    with open_store(tmp_path / "kv", host=4) as s:
        for first in range(1, 7):
            check(s, chain(s, first))


def test_a_failed_flush_at_exit_is_reported_not_silent(tmp_path):
    first_process(tmp_path / "kv")
    r = run(tmp_path / "kv", """
        from kvtier.tiers.disk import DiskTier
        s = open_store(sys.argv[1])
        b = chain(s, 2)
        s.put(b, payload(b, L.block_bytes))
        def broken(*a, **k):
            raise OSError(5, "Input/output error")
        DiskTier.write = broken
    """)
    assert "closing Store at interpreter exit failed" in r.stderr, r.stderr
    assert "not written to disk" in r.stderr and "Input/output error" in r.stderr


def engine(path) -> "kvtier.engine.LLM":
    from kvtier import StoreConfig
    from kvtier.engine import LLM
    return LLM("kimi-tiny", cache=StoreConfig(host_capacity=None, disk_path=str(path), disk_capacity="16MiB"))


def generate(llm, first: int) -> dict:
    """One prompt of 80 tokens `first`; where its cached blocks came from."""
    from kvtier.engine import SamplingParams
    return llm.generate([[first] * 80], SamplingParams(max_tokens=1))[0].cached_by_tier


def test_an_engine_never_closed_keeps_what_it_computed_after_a_disk_hit(tmp_path):
    """The reference engine's store, its disk tier used by a prefix hit, flushes at exit."""
    with engine(tmp_path / "kv") as llm:
        generate(llm, 1)
    run(tmp_path / "kv", """
        llm = engine(sys.argv[1])
        assert generate(llm, 1) == {"disk": 4}, "the first prompt is read from disk"
        generate(llm, 2)
    """)
    with engine(tmp_path / "kv") as llm:
        assert generate(llm, 2) == {"disk": 4}, "the second prompt was written at exit"
