"""kvtier.integrations.vllm: the vLLM v1 KV connector.

Two kinds of tests:
- real vLLM on the CPU (skipped without vLLM: `pip install 'kvtier[vllm]'`): tiny random
  checkpoints (tests/vllm_models.py), each engine in a process of its own
  (tests/vllm_run.py), engines sharing a disk tier one after the other, outputs compared
  token for token with vLLM without the connector;
- the connector's parts without vLLM: configuration, layouts derived from cache tensors,
  the scheduler/worker protocol with fake requests, layer-wise loads, failed loads.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvtier
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import model_revision, parse_config
from kvtier.integrations.vllm.pages import KVSpec, describe_caches
from kvtier.integrations.vllm.plan import StepPlan
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide

torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from vllm_models import prompt_ids, write_model  # noqa: E402

# Prompts: a 600-token shared prefix (a system prompt) and different tails.
PREFIX = prompt_ids(600, 1)
A = prompt_ids(50, 2, prefix=PREFIX)        # 650 tokens
B = prompt_ids(70, 3, prefix=PREFIX)        # 670 tokens
BLOCK = {"llama": 128, "deepseek_v3": 16}   # vLLM's CPU block sizes (MHA, MLA)


# ------------------------------------------------------------------ real vLLM

def run_engine(tmp: Path, model: Path, prompts: list[list[int]], connector: dict | None = None, *,
               multiprocess: bool = False, kv_params: list | None = None, max_tokens: int = 8,
               lag: bool = False, prefix_caching: bool = True, stats: bool = False) -> dict:
    """One vLLM engine in a child process; returns its JSON result (outputs, kvtier counters;
    with `stats`, vLLM's cache-hit counters by source: tests/vllm_run.py)."""
    job = tmp / f"job-{os.urandom(4).hex()}.json"
    job.write_text(json.dumps({"model": str(model), "prompts": prompts, "connector": connector,
                               "multiprocess": multiprocess, "kv_params": kv_params, "max_tokens": max_tokens,
                               "lag": lag, "prefix_caching": prefix_caching, "stats": stats}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, str(TESTS / "vllm_run.py"), str(job)], capture_output=True, text=True,
                       env=env, timeout=400)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        pytest.fail(f"vLLM engine failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("models")
    return {k: write_model(root / k, k) for k in BLOCK}


@pytest.fixture(scope="module")
def baseline(models, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Greedy outputs of vLLM without the connector (same engine settings)."""
    tmp = tmp_path_factory.mktemp("baseline")
    return {k: [o["tokens"] for o in run_engine(tmp, m, [A, B])["outputs"]] for k, m in models.items()}


def disk_config(path: Path) -> dict:
    return {"host_capacity": "32MiB", "disk_path": str(path), "disk_capacity": "128MiB"}


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_second_engine_loads_the_first_engines_prefix(kind, models, baseline, tmp_path):
    conn = disk_config(tmp_path / "disk")
    bt = BLOCK[kind]
    first = run_engine(tmp_path, models[kind], [A], conn)
    assert first["outputs"][0]["tokens"] == baseline[kind][0]
    saved = (len(A) + 8 - 1) // bt             # the KV of the prompt and 7 of the 8 tokens generated
    assert first["kvtier"]["save_blocks"] == saved
    # A new vLLM instance (a new process: nothing in vLLM's own cache) on the same disk tier.
    second = run_engine(tmp_path, models[kind], [B, A], conn, kv_params=[{"x-session-affinity": "agent-7"}, None])
    out_b, out_a = second["outputs"]
    assert second["kvtier"]["recovered"] == saved
    assert out_b["cached"] == len(PREFIX) // bt * bt          # the shared prefix's full blocks, from kvtier
    assert out_a["cached"] == (len(A) - 1) // bt * bt         # all of A but its last token's block
    assert [out_b["tokens"], out_a["tokens"]] == [baseline[kind][1], baseline[kind][0]]
    k = second["kvtier"]
    assert k["load_failed_blocks"] == 0 and k["save_errors"] == 0 and k["corrupt_blocks"] == 0
    assert k["pinned_sessions"] == 1


def test_default_multiprocess_mode(models, baseline, tmp_path):
    """vLLM's default: the scheduler and the worker in separate processes (lookups over the node)."""
    conn = disk_config(tmp_path / "disk")
    run_engine(tmp_path, models["llama"], [A], conn, multiprocess=True)
    second = run_engine(tmp_path, models["llama"], [B, A], conn, multiprocess=True)
    out_b, out_a = second["outputs"]
    assert out_b["cached"] == 512 and out_a["cached"] == 640
    assert [out_b["tokens"], out_a["tokens"]] == [baseline["llama"][1], baseline["llama"][0]]


def test_vllm_reports_kvtier_hits_by_tier(models, baseline, tmp_path):
    """vLLM's per-source hit metric (vllm:prompt_tokens_cached_by_source, what `/metrics`
    serves) splits kvtier's hits into host and disk (get_external_cache_hit_sources), not
    external_unspecified. A first engine fills the disk tier; a second (vLLM's own prefix
    cache off) loads B's shared prefix from disk (4 blocks), which promotes those blocks to
    host memory; then A: those 4 from host and A's fifth block from disk; A again: all 5
    from host (the fifth promoted by the load before)."""
    conn = disk_config(tmp_path / "disk")
    run_engine(tmp_path, models["llama"], [A], conn)
    second = run_engine(tmp_path, models["llama"], [B, A, A], conn, prefix_caching=False, stats=True)
    assert [o["cached"] for o in second["outputs"]] == [512, 640, 640]
    assert [o["tokens"] for o in second["outputs"]] == [baseline["llama"][1]] + [baseline["llama"][0]] * 2
    assert second["external_hits"] == 512 + 640 + 640
    assert second["hit_sources"] == {"disk": 512 + 128, "host": 512 + 640}


def test_the_next_turn_loads_the_blocks_the_last_answer_filled(models, tmp_path):
    """An agent's next prompt is its last prompt, the answer, and more: the answer's full
    blocks were saved as it was generated, so a new instance offers them as cached."""
    conn = disk_config(tmp_path / "disk")
    first = run_engine(tmp_path, models["llama"], [A], conn, max_tokens=120)   # 650 + 120 tokens
    answer = first["outputs"][0]["tokens"]
    assert first["kvtier"]["save_blocks"] == 6                   # 5 of the prompt, 1 filled by the answer
    turn = A + answer + prompt_ids(30, 4)
    alone = run_engine(tmp_path, models["llama"], [turn])["outputs"][0]["tokens"]
    second = run_engine(tmp_path, models["llama"], [turn], conn)["outputs"][0]
    assert second["cached"] == 768                               # 640 without the answer's block
    assert second["tokens"] == alone


def test_a_block_completed_by_the_last_step_is_saved_after_the_request_finished(models, tmp_path):
    """With vLLM's asynchronous scheduling a block's save comes a step after its KV, so a
    request whose last step completed a block ended before its save was planned: the block
    was lost. The connector now saves it in the next step and vLLM frees the pages only once
    the worker reports them sent (request_finished's delayed free; run here on vLLM's CPU
    engine with the scheduler's view of the tokens held one step back, as asynchronous
    scheduling has it)."""
    conn = disk_config(tmp_path / "disk")
    # KV of 768 tokens: the last step completes block 6. Offline, vLLM steps again only for the
    # next request (a server's engine loop steps on by itself): a short one, with no block.
    first = run_engine(tmp_path, models["llama"], [A, A[:5]], conn, max_tokens=119, lag=True)
    answer = first["outputs"][0]["tokens"]
    assert first["kvtier"]["save_blocks"] == 6                   # 5 of the prompt, 1 filled by the answer
    assert first["kvtier"]["final_saves"] == 1
    turn = A + answer + prompt_ids(30, 4)
    alone = run_engine(tmp_path, models["llama"], [turn])["outputs"][0]["tokens"]
    second = run_engine(tmp_path, models["llama"], [turn], conn)["outputs"][0]
    assert second["cached"] == 768 and second["tokens"] == alone


def test_multiprocess_engine_loads_a_live_peers_prefix(models, baseline, tmp_path):
    """Two live instances, no shared disk: the second (vLLM's default multiprocess mode, as
    under `vllm serve`) offers and loads the prefix the first holds in host memory (its
    scheduler asks its worker's node FIND: the worker's tiers, then its peers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "kvtier-test-secret-0123456789"
    hold = tmp_path / "release"
    job = tmp_path / "first.json"
    job.write_text(json.dumps({"model": str(models["llama"]), "prompts": [A], "max_tokens": 8, "hold": str(hold),
                               "connector": {"host_capacity": "32MiB", "listen": f"127.0.0.1:{port}",
                                             "secret": secret}}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    first = subprocess.Popen([sys.executable, str(TESTS / "vllm_run.py"), str(job)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = first.stdout.readline()          # its result: A is saved in its host tier, its node serving
        while line and not line.startswith("{"):
            line = first.stdout.readline()
        if not line:
            pytest.fail(f"first vLLM engine failed:\n{first.stderr.read()[-4000:]}")
        assert json.loads(line)["kvtier"]["save_blocks"] == 5
        second = run_engine(tmp_path, models["llama"], [B, A], multiprocess=True,
                            connector={"host_capacity": "32MiB", "peers": [f"127.0.0.1:{port}"], "secret": secret})
    finally:
        hold.touch()
        first.communicate(timeout=120)
    out_b, out_a = second["outputs"]
    assert out_b["cached"] == 512 and out_a["cached"] == 640     # the first's blocks were offered and loaded
    assert [out_b["tokens"], out_a["tokens"]] == [baseline["llama"][1], baseline["llama"][0]]


def _corrupt(disk: Path, fraction: float, seed: int = 0) -> tuple[dict, set[bytes]]:
    """Flip bytes inside a seeded fraction of the stored blocks; returns the tier's meta and their keys."""
    from kvtier.tiers.disk_dir import read_directory

    (sub,) = [p.parent for p in disk.glob("*/index.lmdb")]
    meta, records = read_directory(sub)
    rng = np.random.default_rng(seed)
    bad = [r for r in records if rng.random() < fraction] or records[:1]
    with open(sub / "slab.bin", "r+b") as f:
        for _, (slot, *_rest) in bad:
            off = slot * meta["slot_bytes"] + 777
            f.seek(off)
            b = f.read(16)
            f.seek(off)
            f.write(bytes(x ^ 0x5A for x in b))
    return meta, {k for k, _ in bad}


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_corrupt_blocks_are_recomputed(kind, models, baseline, tmp_path):
    conn = disk_config(tmp_path / "disk")
    bt = BLOCK[kind]
    run_engine(tmp_path, models[kind], [A], conn)
    # Llama: half the blocks, so vLLM recomputes on top of a loaded prefix (exact on the CPU).
    # MLA: every block, so it recomputes from block 0: vLLM's CPU MLA backend computes a
    # prefill over cached context inexactly (0.01-0.2 nats here, the same with vLLM's own
    # prefix cache forced on; docs/vllm.md), which would make the comparison test vLLM, not kvtier.
    meta, bad = _corrupt(tmp_path / "disk", 0.5 if kind == "llama" else 1.0)
    from kvtier.integrations.vllm.plan import request_keys
    n = len(A) // bt
    chain = request_keys(A[:n * bt], bt, bytes.fromhex(meta["namespace_seed"]), meta["hash"])
    first_bad = min(i for i, key in enumerate(chain) if key in bad)
    second = run_engine(tmp_path, models[kind], [A, A], conn)
    (o1, o2) = second["outputs"]
    assert o1["tokens"] == baseline[kind][0] and o2["tokens"] == baseline[kind][0]
    # Cached = not computed: the blocks before the first corrupt one, not the recomputed ones.
    assert o1["cached"] == min(first_bad, (len(A) - 1) // bt) * bt
    k = second["kvtier"]
    assert k["load_failed_blocks"] >= 1 and k["corrupt_blocks"] >= 1
    # The recomputed blocks were saved again: the repeat is a full hit.
    assert o2["cached"] == (len(A) - 1) // bt * bt


def test_another_checkpoint_in_the_same_place_never_hits(models, tmp_path):
    conn = disk_config(tmp_path / "disk")
    model = write_model(tmp_path / "m", "llama", seed=0)
    run_engine(tmp_path, model, [A], conn)
    write_model(tmp_path / "m", "llama", seed=1)      # retrained weights, same directory and config
    out = run_engine(tmp_path, model, [A], conn)
    assert out["outputs"][0]["cached"] == 0 and out["kvtier"]["recovered"] == 0
    assert len(list((tmp_path / "disk").glob("*/index.lmdb"))) == 2


# ------------------------------------------------------------------ without vLLM

def test_config_defaults_and_shorthand(tmp_path):
    c = parse_config({})
    assert [t.kind for t in c.tiers_spec] == ["host"] and c.failure_policy == "recompute" and c.secret is None
    assert c.store == kvtier.StoreConfig()                  # kvtier's one set of defaults
    c = parse_config({"host_capacity": "2GiB", "disk_path": str(tmp_path), "policy": "arc", "pin_ttl": 60})
    # no disk_capacity: the folder keeps its present size (16GiB for a new one), as everywhere
    assert [(t.kind, t.args.get("capacity")) for t in c.tiers_spec] == [("host", "2GiB"), ("disk", None)]
    assert c.store.policy == "arc" and c.store.pin_ttl == 60 and c.store.disk_capacity is None
    assert c.store.disk_path == str(tmp_path)


def test_config_file_and_inline_override(tmp_path):
    f = tmp_path / "kvtier.json"
    f.write_text(json.dumps({"host_capacity": "2GiB", "disk_path": "/x", "write_through": True}))
    c = parse_config({"config_file": str(f), "disk_path": str(tmp_path / "d")})
    assert c.store.write_through and c.store.disk_path == str(tmp_path / "d")
    assert c.tiers_spec[0].args["capacity"] == "2GiB"


@pytest.mark.parametrize("value", ["", "  ", 5, ["/etc/kvtier.json"]])
def test_config_file_must_be_a_path(value):
    """"" was ignored silently (no file read); 5 said "cannot read the config file 5"."""
    with pytest.raises(ConfigError, match=r"'config_file'\] must be the path of a JSON or TOML file .*leave the key out"):
        parse_config({"config_file": value})


def test_config_file_errors_name_the_file(tmp_path):
    f = tmp_path / "kvtier.json"
    f.write_text(json.dumps({"host_capacty": "2GiB"}))
    with pytest.raises(ConfigError, match=r"unknown kvtier connector setting\(s\) \['host_capacty'\] in config file "
                                          + re.escape(str(f))):
        parse_config({"config_file": str(f)})
    with pytest.raises(ConfigError, match=r"\['hostcapacity'\] in kv_connector_extra_config"):
        parse_config({"config_file": str(f), "hostcapacity": 1})
    f.write_text(json.dumps({"policy": "nope"}))
    with pytest.raises(ConfigError, match=r"unknown policy 'nope'.*settings from config file " + re.escape(str(f))):
        parse_config({"config_file": str(f)})


@pytest.mark.parametrize("extra, match", [
    ({"host_capacity": "1GiB", "hostcapacity": 1}, "unknown kvtier connector setting"),
    ({"peers": ["10.0.0.2:7700"]}, "secret"),
    ({"disk_capacity": "1GiB"}, "disk_path"),
    ({"disk_io_threads": 2}, "disk_io_threads needs disk_path"),     # was ignored
    ({"disk_path": 123}, "disk_path'\\] must be a non-empty string"),   # made a folder ./123
    ({"disk_path": ""}, "disk_path'\\] must be a non-empty string"),    # meant no disk tier
    # a remote tier's bad timeout or stray key was a TypeError in vLLM's worker
    ({"tiers": [{"kind": "host", "capacity": "1MiB"}, {"kind": "remote", "peers": ["a:1"], "timeout": "x"}],
      "secret": "s" * 32}, "remote tier's timeout must be a number of seconds > 0"),
    ({"tiers": [{"kind": "host", "capacity": "1MiB"}, {"kind": "remote", "peers": ["a:1"], "bogus": 1}],
      "secret": "s" * 32}, "unknown setting 'bogus'"),
    ({"peers": ["a:1"], "remote_timeout": 0, "secret": "s" * 32}, "timeout must be a number of seconds > 0"),
    ({"save_generated": "yes"}, r"'save_generated'\] must be true or false"),
    ({"host_capacity": "lots"}, "cannot parse size"),
    ({"host_capacity": 0}, "always has a host tier"),
    ({"host_capacity": "none"}, "always has a host tier"),
    ({"host_capacity": None}, "always has a host tier"),
    ({"host_capacity": "0B"}, "always has a host tier"),
    ({"tiers": [{"kind": "disk", "path": "/x", "capacity": "1GiB"}]}, "first tier must be the one host tier"),
    ({"tiers": [], "host_capacity": "1GiB"}, "not both"),
    ({"failure_policy": "ignore"}, "failure_policy"),
    ({"hash": "md5"}, "hash must be one of"),
    ({"tiers": [{"kind": "host", "capacity": "1GiB", "pinned": True}]}, "unknown setting 'pinned'"),
    ({"config_file": "/nonexistent/kvtier.json"}, "cannot read"),
    # each refused at the config check and named (they were taken silently, or failed unnamed
    # or only in vLLM's worker after the model loaded)
    ({"host_capacity": -5}, "the host tier's capacity: size must be >= 0"),
    ({"max_pending_save": 0}, r"max_pending_save'\] must be more than 0 bytes"),
    ({"peers": "10.0.0.1:7700", "secret": "s" * 16}, r"'peers'\] must be a list"),
    ({"session_param": 5}, r"'session_param'\] must be a non-empty string"),
    ({"salt": 5}, r"'salt'\] must be a string"),
    ({"min_hit_blocks": 1.5}, "whole number"),
    ({"model": 5}, r"'model'\] must be a non-empty string"),
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"transport": "udp"}, "transport must be one of"),
    ({"listen": "nohost"}, r"'listen'\]: address 'nohost'"),
])
def test_config_errors_say_what_to_do(extra, match, monkeypatch):
    monkeypatch.delenv("KVTIER_SECRET", raising=False)
    with pytest.raises(ConfigError, match=match):
        parse_config(extra)


def test_model_revision_fingerprints_local_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100_000)
    r1 = model_revision(str(tmp_path), None)
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 99_999 + b"\1")      # same size, new weights
    assert model_revision(str(tmp_path), None) != r1
    assert model_revision(str(tmp_path), "abc123") == "abc123"
    assert model_revision("meta-llama/Llama-3.1-8B", None) == ""


def test_layouts_from_cache_tensors():
    # CPU MHA: [P, kv_heads, T, 2*D]; FlashAttention: [2, P, T, H, D]; CPU MLA: [P, 1, T, 576].
    cpu = {f"l{i}": torch.zeros(8, 2, 16, 64) for i in range(3)}
    v = describe_caches(cpu, KVSpec(16, 8, False, 2, 32, "LBHNC"))
    assert v.layout.kind == "mha" and v.layout.layer_bytes == 2 * 16 * 64 * 4
    assert (v.paged.format, v.paged.parts, v.paged.pages_per_block) == ("pages", 1, 1)
    fa = {f"l{i}": torch.zeros(2, 8, 16, 2, 32) for i in range(3)}
    v2 = describe_caches(fa, KVSpec(16, 8, False, 2, 32, "NHD"))
    assert (v2.paged.format, v2.paged.parts) == ("pages", 2) and v2.layout.fingerprint != v.layout.fingerprint
    mla = {f"l{i}": torch.zeros(8, 1, 16, 576, dtype=torch.bfloat16) for i in range(2)}
    v3 = describe_caches(mla, KVSpec(16, 8, True, 1, 576))
    assert v3.layout.kind == "mla" and v3.layout.block_bytes == 2 * 16 * 576 * 2 and v3.layer_index("l1") == 1


# Layout fingerprints (they key stored blocks) as they were before the move to PagedKV.of_pages.
FINGERPRINTS = {"cpu": "4deecd5464225d59ac213f288efe690f", "fa": "3787569cfa572256198baadbd0400b37",
                "mla": "6f327a4ce2b77ac877bfec52d080adb0"}


def test_pages_move_the_same_bytes_as_before():
    """PagedKV.of_pages stores exactly the bytes the borrowed-view formats did ("flashinfer"
    for [P, ...] MHA pages, "vllm" for [2, P, ...], "mla"), under the same layouts."""
    from kvtier.transfer.pages import PagedKV

    g = torch.Generator().manual_seed(0)
    cases = [("cpu", (8, 2, 16, 64), KVSpec(16, 8, False, 2, 32, "LBHNC"), "flashinfer", (8, 2, 16, 2, 32)),
             ("fa", (2, 8, 16, 2, 32), KVSpec(16, 8, False, 2, 32, "NHD"), "vllm", (2, 8, 16, 2, 32)),
             ("mla", (8, 1, 16, 576), KVSpec(16, 8, True, 1, 576), "mla", (8, 16, 576))]
    table = [[5], [0], [7]]
    for name, shape, spec, old_fmt, old_view in cases:
        caches = {f"l{i}": torch.randn(shape, generator=g) for i in range(3)}
        v = describe_caches(caches, spec)
        old = PagedKV([t.view(old_view) for t in caches.values()], v.layout, old_fmt)
        blocks = v.paged.gather(table)
        assert torch.equal(blocks, old.gather(table)), name
        assert v.layout.fingerprint.hex() == FINGERPRINTS[name], name
        dst = {k: torch.zeros_like(t) for k, t in caches.items()}
        describe_caches(dst, spec).paged.scatter(blocks, [[1], [2], [3]])
        assert torch.equal(PagedKV([t.view(old_view) for t in dst.values()], v.layout, old_fmt).gather([[1], [2], [3]]),
                           blocks), name


@pytest.mark.parametrize("caches, match", [
    ({"a": torch.zeros(8, 2, 16, 64), "b": torch.zeros(8, 2, 16, 32)}, "one cache shape"),
    ({"a": torch.zeros(8, 2, 16, 64).transpose(1, 2)}, "not contiguous"),
    ({"a": torch.zeros(3, 8, 16, 64)}, "neither 8 pages first"),
    ({"a": torch.zeros(8, 2, 16, 48)}, "padded or quantized"),
])
def test_unsupported_caches_are_refused(caches, match):
    with pytest.raises(ConfigError, match=match):
        describe_caches(caches, KVSpec(16, 8, False, 2, 32))


# A scheduler and a worker wired together in this process, with fake vLLM objects.

L, P, T = 3, 32, 4          # layers, vLLM pages, tokens per page (= kvtier block)


def _caches() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.zeros(P, 2, T, 16) for i in range(L)}      # 2 heads x (K 8 + V 8)


@pytest.fixture
def pair(tmp_path):
    cfg = parse_config({"host_capacity": "1MiB", "disk_path": str(tmp_path / "disk"), "disk_capacity": "4MiB"})
    w = WorkerSide(cfg, "tiny", "r1", 0, 1)
    caches = _caches()
    w.register(caches, KVSpec(T, P, False, 2, 8, "LBHNC"), list(caches))
    s = SchedulerSide(cfg, T)
    s.set_workers([w.handshake()])
    yield s, w, caches
    w.close()


def test_a_worker_whose_node_cannot_listen_leaves_its_store_closed(tmp_path):
    """A port in use failed the worker after its store took the disk tier's lock: a retry in
    the same process was refused ("in use by another store")."""
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        settings = {"host_capacity": "1MiB", "disk_path": str(tmp_path / "disk"), "disk_capacity": "4MiB"}
        caches = _caches()
        w = WorkerSide(parse_config({**settings, "listen": f"127.0.0.1:{busy.getsockname()[1]}"}), "tiny", "r1", 0, 1)
        with pytest.raises(kvtier.ConfigError, match="in use"):
            w.register(caches, KVSpec(T, P, False, 2, 8, "LBHNC"), list(caches))
    finally:
        busy.close()
    w = WorkerSide(parse_config(settings), "tiny", "r1", 0, 1)
    w.register(caches, KVSpec(T, P, False, 2, 8, "LBHNC"), list(caches))
    w.close()


def _request(rid: str, tokens: list[int], **kw) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_tokens=len(tokens), lora_request=None,
                           cache_salt=None, mm_features=[], prompt_embeds=None, kv_transfer_params=None, **kw)


def _step(s: SchedulerSide, w: WorkerSide, req, pages: list[int], computed: int, scheduled: int,
          new: bool = True, between=None) -> StepPlan:
    """One engine step through the connector, as vLLM drives it."""
    r = SimpleNamespace(req_id=req.request_id, block_ids=(pages,), num_computed_tokens=computed)
    so = SimpleNamespace(scheduled_new_reqs=[r] if new else [],
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[] if new else [req.request_id],
                                                               num_computed_tokens=[] if new else [computed]),
                         num_scheduled_tokens={req.request_id: scheduled}, preempted_req_ids=set())
    plan = s.build(so, lambda rid: pages)
    w.ingest(plan)
    w.start_load(plan)
    for i in range(L):
        w.wait_layer(f"layer{i}")
        if between is not None:
            between(i)
    w.end_step(plan)
    s.on_output(w.load_errors())
    w.drain()
    return plan


def _admit(s: SchedulerSide, req, pages: list[int]) -> int:
    ext = s.match(req, 0)
    s.after_alloc(req, pages, ext)
    return ext


def test_save_then_load_into_other_pages(pair):
    s, w, caches = pair
    toks = list(range(100, 118))                    # 18 tokens: 4 full blocks
    req = _request("r1", toks)
    assert _admit(s, req, [0, 1, 2, 3, 4]) == 0
    for name, t in caches.items():                  # "the forward pass" writes KV
        t[:5] = torch.randn(5, 2, T, 16)
    plan = _step(s, w, req, [0, 1, 2, 3, 4], 0, 18)
    assert [(r.start, r.end) for r in plan.saves] == [(0, 4)]
    s.finished("r1")
    # Another request with the same first 10 tokens: 2 blocks load into its own pages.
    req2 = _request("r2", toks[:10] + [7, 7, 7])
    assert _admit(s, req2, [10, 11, 12, 13]) == 2 * T
    plan = _step(s, w, req2, [10, 11, 12, 13], 2 * T, 5)
    assert [(r.start, r.end, r.pages) for r in plan.loads] == [(0, 2, [10, 11])]
    for t in caches.values():
        assert torch.equal(t[10:12], t[0:2])
    assert w.load_errors() == set() and w.counters["load_blocks"] == 2


@pytest.mark.parametrize("save_generated", [True, False])
def test_blocks_filled_by_generated_tokens_are_saved(pair, save_generated):
    """An agent's next turn starts with the last turn's answer: blocks filled by generated
    tokens are keyed from the tokens vLLM accepted (never from draft tokens, which may be
    rejected) and saved; the next request loads them (unless save_generated is off)."""
    s, w, caches = pair
    s.cfg.save_generated = save_generated
    toks = list(range(100, 118))                    # 18 tokens: 4 full blocks
    gen = [300, 301, 302, 303, 304, 305]
    req = _request("r1", toks, all_token_ids=list(toks))
    _admit(s, req, [0, 1, 2, 3, 4, 5])
    for t in caches.values():
        t[:6] = torch.randn(6, 2, T, 16)
    assert [(r.start, r.end) for r in _step(s, w, req, [0, 1, 2, 3, 4, 5], 0, 18).saves] == [(0, 4)]
    req.all_token_ids = toks + gen[:1]              # decode: token 19 with two draft tokens
    plan = _step(s, w, req, [0, 1, 2, 3, 4, 5], 18, 3, new=False)
    assert plan.saves == [] and plan.grown == []    # 21 tokens computed, but only 19 accepted
    req.all_token_ids = toks + gen[:3]              # two accepted: block 4 (tokens 16..19) is whole
    plan = _step(s, w, req, [0, 1, 2, 3, 4, 5], 20, 1, new=False)
    if save_generated:
        assert [(g.req_id, g.token_ids) for g in plan.grown] == [("r1", toks[16:] + gen[:2])]
        assert [(r.start, r.end, r.pages) for r in plan.saves] == [(4, 5, [4])]
    else:
        assert plan.grown == plan.saves == []
    s.finished("r1")
    w.finished({"r1"})
    # The next turn: the prompt, the answer, and more.
    req2 = _request("r2", toks + gen[:3] + [9, 9, 9])
    want = 5 if save_generated else 4
    assert _admit(s, req2, [10, 11, 12, 13, 14, 15]) == want * T
    _step(s, w, req2, [10, 11, 12, 13, 14, 15], want * T, 24 - want * T)
    for t in caches.values():
        assert torch.equal(t[10:10 + want], t[0:want])


@pytest.mark.parametrize("tainted", [False, True])
def test_a_finished_requests_last_block_is_saved_next_step_and_its_pages_released(pair, monkeypatch, tainted):
    """Asynchronous scheduling (the scheduler sees the tokens a step late): the block the last
    step completed is saved in the step after the request finished, and the workers report
    the request sent so vLLM frees its pages; also when that save is skipped (a failed load
    tainted the request), or vLLM would hold the pages for good."""
    s, w, caches = pair
    monkeypatch.setattr(s, "_known", lambda r: list(r.all_token_ids)[:-1])
    toks, gen = list(range(100, 118)), [300, 301, 302]
    req = _request("r1", toks, all_token_ids=list(toks))
    _admit(s, req, [0, 1, 2, 3, 4, 5])
    for t in caches.values():
        t[:6] = torch.randn(6, 2, T, 16)
    _step(s, w, req, [0, 1, 2, 3, 4, 5], 0, 18)
    req.all_token_ids = toks + gen[:1]
    _step(s, w, req, [0, 1, 2, 3, 4, 5], 18, 1, new=False)
    req.all_token_ids = toks + gen[:2]
    plan = _step(s, w, req, [0, 1, 2, 3, 4, 5], 19, 1, new=False)      # completes block 4 (tokens 16..19)
    assert plan.saves == []                                             # its last token not yet known
    req.all_token_ids, req.num_computed_tokens = toks + gen, 20          # it finished: max_tokens
    assert s.finish(req, [0, 1, 2, 3, 4, 5]) is True                    # vLLM keeps the pages
    if tainted:
        w._tainted["r1"] = 4
    idle = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                           num_computed_tokens=[]), num_scheduled_tokens={}, preempted_req_ids=set())
    plan = s.build(idle, lambda rid: [])
    assert plan.final == ["r1"] and [(r.start, r.end, r.pages) for r in plan.saves] == [(4, 5, [4])]
    w.ingest(plan)
    w.start_load(plan)
    w.end_step(plan)
    w.drain()
    assert w.sent() == {"r1"} and w.sent() == set()                    # reported once
    w.finished({"r1"})
    assert w.store.lookup(w.store.keys(toks + gen[:2])).blocks == (4 if tainted else 5)
    assert s.build(idle, lambda rid: []).empty()


def test_an_answer_to_a_prompt_shorter_than_a_block_is_saved(pair):
    s, w, caches = pair
    toks, gen = [100, 101, 102], [300, 301, 302, 303, 304, 305]
    req = _request("r1", toks, all_token_ids=list(toks))
    assert _admit(s, req, [0, 1, 2]) == 0
    for t in caches.values():
        t[:3] = torch.randn(3, 2, T, 16)
    assert _step(s, w, req, [0, 1, 2], 0, 3).saves == []
    req.all_token_ids = toks + gen[:2]
    plan = _step(s, w, req, [0, 1, 2], 3, 1, new=False)            # 4 tokens' KV: block 0 is whole
    assert [(r.start, r.end) for r in plan.saves] == [(0, 1)]
    s.finished("r1")
    w.finished({"r1"})
    req2 = _request("r2", toks + gen[:2] + [9, 9])
    assert _admit(s, req2, [10, 11]) == T
    _step(s, w, req2, [10, 11], T, 3)
    for t in caches.values():
        assert torch.equal(t[10], t[0])


def test_a_request_preempted_and_resumed_in_one_step_keeps_its_load(pair):
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts running requests and
    schedules them again in the same step: both in preempted_req_ids and scheduled. The load
    planned for the new pages must stand (vLLM counts those tokens as loaded)."""
    s, w, caches = pair
    toks = list(range(100, 118))
    first = _request("r1", toks)
    _admit(s, first, [0, 1, 2, 3, 4])
    for t in caches.values():
        t[:5] = torch.randn(5, 2, T, 16)
    _step(s, w, first, [0, 1, 2, 3, 4], 0, 18)
    s.finished("r1")
    req = _request("r2", toks[:10] + [7, 7, 7])
    assert _admit(s, req, [10, 11, 12, 13]) == 2 * T
    r = SimpleNamespace(req_id="r2", block_ids=([10, 11, 12, 13],), num_computed_tokens=2 * T)
    so = SimpleNamespace(scheduled_new_reqs=[r], scheduled_cached_reqs=SimpleNamespace(req_ids=[],
                         num_computed_tokens=[]), num_scheduled_tokens={"r2": 5}, preempted_req_ids={"r2"})
    plan = s.build(so, lambda rid: [10, 11, 12, 13])
    assert [(x.start, x.end, x.pages) for x in plan.loads] == [(0, 2, [10, 11])]


def _blocks(w: WorkerSide, n: int) -> np.ndarray:
    return np.random.default_rng(n).integers(0, 255, (n, w.store.layout.block_bytes), dtype=np.uint8)


def test_hit_sources_name_the_tier_of_each_loaded_block(tmp_path):
    """get_external_cache_hit_sources' split (the scheduler in the worker's process: the
    store's lookup says each block's tier): blocks a new instance recovered on disk are
    "disk"; loading them promotes them to host memory, and the next lookup says "host"."""
    settings = {"host_capacity": "1MiB", "disk_path": str(tmp_path / "disk"), "disk_capacity": "4MiB"}
    toks = list(range(100, 118))                    # 4 full blocks
    w = WorkerSide(parse_config(settings), "tiny", "r1", 0, 1)
    w.register(_caches(), KVSpec(T, P, False, 2, 8, "LBHNC"), list(_caches()))
    w.store.put(w.store.keys(toks), _blocks(w, 4))
    w.close()                                       # flushed to disk
    w = WorkerSide(parse_config(settings), "tiny", "r1", 0, 1)
    caches = _caches()
    w.register(caches, KVSpec(T, P, False, 2, 8, "LBHNC"), list(caches))
    s = SchedulerSide(parse_config(settings), T)
    s.set_workers([w.handshake()])
    try:
        assert s.hit_sources(_request("r0", toks), 0) == {}
        req = _request("r1", toks[:10] + [7, 7])    # blocks 0, 1 cached; 3 tokens to compute
        assert _admit(s, req, [0, 1, 2]) == 2 * T
        assert s.hit_sources(req, 2 * T) == {"disk": 2 * T}
        _step(s, w, req, [0, 1, 2], 2 * T, 4)       # the load promotes blocks 0, 1 to host memory
        s.finished("r1")
        w.finished({"r1"})
        req = _request("r2", toks + [9])
        assert _admit(s, req, [4, 5, 6, 7, 8]) == 4 * T
        assert s.hit_sources(req, 4 * T) == {"host": 2 * T, "disk": 2 * T}
        # vLLM's own prefix cache held block 0: kvtier loads blocks 1..3.
        req = _request("r3", toks + [9])
        assert s.match(req, T) == 3 * T
        s.after_alloc(req, [4, 5, 6, 7, 8], 3 * T)
        assert s.hit_sources(req, 3 * T) == {"host": T, "disk": 2 * T}
        # vLLM counted fewer or more tokens than planned: the counts still add up.
        assert s.hit_sources(req, 2 * T) == {"host": T, "disk": T}
        assert s.hit_sources(req, 4 * T) == {"host": T, "disk": 2 * T, "external_unspecified": T}
        assert s.hit_sources(_request("unknown", toks), T) == {"external_unspecified": T}
    finally:
        s.close()
        w.close()


def test_hit_sources_over_the_workers_node(tmp_path, monkeypatch):
    """vLLM's multiprocess mode: the scheduler's FIND at the worker's node answers each
    block's tier there: its own blocks "host", those its peers supply "p2p"."""
    import socket

    from kvtier.integrations.vllm.worker import LOCAL

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    secret = "kvtier-test-secret-0123456789"
    toks = list(range(100, 118))
    peer = WorkerSide(parse_config({"host_capacity": "1MiB", "listen": f"127.0.0.1:{port}", "secret": secret}),
                      "tiny", "r1", 0, 1)
    peer.register(_caches(), KVSpec(T, P, False, 2, 8, "LBHNC"), list(_caches()))
    cfg = parse_config({"host_capacity": "1MiB", "peers": [f"127.0.0.1:{port}"], "secret": secret})
    w = WorkerSide(cfg, "tiny", "r1", 0, 1)
    w.register(_caches(), KVSpec(T, P, False, 2, 8, "LBHNC"), list(_caches()))
    s = SchedulerSide(cfg, T)
    s.set_workers([w.handshake()])
    try:
        keys = w.store.keys(toks)
        peer.store.put(keys, _blocks(peer, 4))
        w.store.put(keys[:1], _blocks(w, 1))
        monkeypatch.delitem(LOCAL, w.address)      # as if the worker ran in another process
        req = _request("r1", toks + [9])
        assert _admit(s, req, [0, 1, 2, 3, 4]) == 4 * T
        assert s._reqs["r1"].sources == [["host", "p2p", "p2p", "p2p"]]   # from the FIND's answer
        assert s.hit_sources(req, 4 * T) == {"host": T, "p2p": 3 * T}
        monkeypatch.setitem(LOCAL, w.address, w)   # in this process: the store's lookup says it
        req = _request("r2", toks + [9])
        assert _admit(s, req, [0, 1, 2, 3, 4]) == 4 * T
        assert s.hit_sources(req, 4 * T) == {"host": T, "p2p": 3 * T}
    finally:
        s.close()
        w.close()
        peer.close()


def test_hit_sources_with_host_and_disk_over_the_node(tmp_path, monkeypatch):
    """The worker in another process (vLLM's multiprocess mode): its node's FIND answers each
    block's tier, so host and disk hits are told apart there too."""
    from kvtier.integrations.vllm.worker import LOCAL

    settings = {"host_capacity": "1MiB", "disk_path": str(tmp_path / "disk"), "disk_capacity": "4MiB"}
    toks = list(range(100, 118))                    # 4 full blocks
    w = WorkerSide(parse_config(settings), "tiny", "r1", 0, 1)
    w.register(_caches(), KVSpec(T, P, False, 2, 8, "LBHNC"), list(_caches()))
    keys = w.store.keys(toks)
    w.store.put(keys[:2], _blocks(w, 2))
    w.close()                                       # flushed: blocks 0, 1 on disk only
    w = WorkerSide(parse_config(settings), "tiny", "r1", 0, 1)
    w.register(_caches(), KVSpec(T, P, False, 2, 8, "LBHNC"), list(_caches()))
    w.store.put(keys[2:], _blocks(w, 2))            # blocks 2, 3 in host memory
    s = SchedulerSide(parse_config(settings), T)
    s.set_workers([w.handshake()])
    try:
        monkeypatch.delitem(LOCAL, w.address)       # as if the worker ran in another process
        req = _request("r1", toks + [9])
        assert _admit(s, req, [0, 1, 2, 3, 4]) == 4 * T
        assert s.hit_sources(req, 4 * T) == {"disk": 2 * T, "host": 2 * T}
    finally:
        s.close()
        w.close()


def test_hit_sources_of_several_ranks_name_the_farthest_tier():
    from kvtier.integrations.vllm.scheduler import outermost

    assert outermost(["host", "disk"]) == "disk" and outermost(["host", "p2p"]) == "p2p"
    assert outermost(["disk", "external_unspecified"]) == "external_unspecified"
    s = SchedulerSide(parse_config({}), T)
    s.workers = [SimpleNamespace(), SimpleNamespace()]
    req = _request("r1", list(range(100, 118)))
    from kvtier.integrations.vllm.plan import BlockRange
    from kvtier.integrations.vllm.scheduler import _Req
    s._reqs["r1"] = _Req(req.prompt_token_ids[:16], 4, b"", None, 600, keys=[[b"k"] * 4] * 2, hit=3,
                         sources=[["host", "host", "disk"], ["host", "p2p", "host"]],
                         pending=BlockRange("r1", 0, 3, [0, 1, 2]))
    assert s.hit_sources(req, 3 * T) == {"host": T, "p2p": T, "disk": T}


def test_tensor_parallel_ranks_are_asked_at_once(monkeypatch):
    """Each rank's FIND may wait on its peers: two ranks must not cost two waits in a row
    (each rank waits for the other at a barrier; asked one after the other, both miss)."""
    import threading

    from kvtier.integrations.vllm.scheduler import WorkerStore

    gate = threading.Barrier(2)

    def lookup(self, keys):
        try:
            gate.wait(timeout=5)
        except threading.BrokenBarrierError:
            return 0, None
        return 3 - self.info["rank"], None
    monkeypatch.setattr(WorkerStore, "lookup", lookup)
    s = SchedulerSide(parse_config({}), T)
    s.set_workers([{"rank": r, "seed": bytes(16), "hash": "xxh3", "block_tokens": T, "address": f"127.0.0.1:{9 + r}",
                    "secret": b"s" * 32} for r in (1, 0)])
    req = _request("r1", list(range(100, 118)))
    assert s.match(req, 0) == 2 * T            # min(3, 2) blocks, both ranks answered
    s.close()


def test_tensor_parallel_ranks_fetch_from_the_same_rank_of_each_peer():
    cfg = parse_config({"peers": ["10.0.0.2:7700", "10.0.0.3:7800"], "secret": "s" * 32})
    assert cfg.build_remote(0).directory.peers == ["10.0.0.2:7700", "10.0.0.3:7800"]
    assert cfg.build_remote(3).directory.peers == ["10.0.0.2:7703", "10.0.0.3:7803"]
    d = parse_config({"directory": "redis://127.0.0.1:6399", "remote_timeout": 2, "secret": "s" * 32})
    pytest.importorskip("redis")
    kwargs = d.build_remote(1).directory.r.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 2   # the remote's deadline (was 0.5)


def test_wait_for_layer_load_waits_for_that_layer_only(pair, monkeypatch):
    s, w, caches = pair
    toks = list(range(200, 213))
    req = _request("r1", toks)
    _admit(s, req, [0, 1, 2, 3])
    for t in caches.values():
        t[:4] = torch.randn(4, 2, T, 16)
    _step(s, w, req, [0, 1, 2, 3], 0, 13)
    s.finished("r1")
    # Hold the adapter's loader thread before it writes layer 1: layer 0 must be usable already.
    import kvtier.transfer.streams as smod

    gate, real = threading.Event(), smod.copy
    views = w.pages.paged.views

    def slow_copy(v, *a, **k):
        if v[0] is views[1]:
            assert gate.wait(10)
        return real(v, *a, **k)

    from kvtier.transfer.pages import ChunkPlan
    real_layer = ChunkPlan.layer

    def slow_layer(plan, l, to_blocks):      # the path taken where kvtier._copy is built
        if l == 1:
            assert gate.wait(10)
        return real_layer(plan, l, to_blocks)

    monkeypatch.setattr(smod, "copy", slow_copy)
    monkeypatch.setattr(ChunkPlan, "layer", slow_layer)
    seen = {}

    def between(i):
        if i == 0:
            seen["l0"] = torch.equal(caches["layer0"][20:23], caches["layer0"][0:3])
            seen["l1"] = torch.equal(caches["layer1"][20:23], caches["layer1"][0:3])
            gate.set()

    req2 = _request("r2", toks)
    assert _admit(s, req2, [20, 21, 22, 23]) == 3 * T
    _step(s, w, req2, [20, 21, 22, 23], 3 * T, 1, between=between)
    assert seen == {"l0": True, "l1": False}
    assert torch.equal(caches["layer2"][20:23], caches["layer2"][0:3])


def test_failed_load_is_reported_recomputed_and_saved_again(pair, monkeypatch):
    s, w, caches = pair
    toks = list(range(300, 317))
    req = _request("r1", toks)
    _admit(s, req, [0, 1, 2, 3, 4])
    for t in caches.values():
        t[:5] = torch.randn(5, 2, T, 16)
    _step(s, w, req, [0, 1, 2, 3, 4], 0, 17)
    s.finished("r1")
    # The store returns only 1 of 3 blocks intact (as a failed checksum does).
    real_reading = w.store.reading

    @contextmanager
    def short_reading(*args, **kw):
        with real_reading(*args, **kw) as held:
            held.blocks = min(held.blocks, 1)
            yield held

    monkeypatch.setattr(w.store, "reading", short_reading)
    # vLLM's prefill statistics as its scheduler sets them: 3 blocks offered, 1 token to compute.
    stats = SimpleNamespace(num_prompt_tokens=13, num_computed_tokens=1, num_cached_tokens=3 * T,
                            num_local_cached_tokens=0, num_external_cached_tokens=3 * T)
    req2 = _request("r2", toks[:13], prefill_stats=stats)
    assert _admit(s, req2, [10, 11, 12, 13]) == 3 * T
    errors = {}
    real_errors = w.load_errors

    def spy():
        errors["ids"] = real_errors()
        return errors["ids"]

    monkeypatch.setattr(w, "load_errors", spy)
    plan = _step(s, w, req2, [10, 11, 12, 13], 3 * T, 1)
    assert errors["ids"] == {11, 12}                        # vLLM recomputes from block 1
    # RequestOutput.num_cached_tokens counts the loaded block only, not the recomputed ones.
    assert (stats.num_cached_tokens, stats.num_external_cached_tokens, stats.num_computed_tokens) == (T, T, 13 - T)
    assert "r2" in w._tainted
    # vLLM recomputes tokens 4.. ; those blocks are saved again, the taint lifted first.
    monkeypatch.setattr(w.store, "reading", real_reading)
    plan = _step(s, w, req2, [10, 11, 12, 13], T, 9, new=False)
    assert plan.resync == ["r2"] and [(r.start, r.end) for r in plan.saves] == [(1, 3)]
    assert "r2" not in w._tainted and w.counters["save_skipped_blocks"] == 0


def test_a_sessions_pin_covers_its_answers_blocks(pair):
    """The session's next prompt is this prompt plus the answer: the blocks generated tokens
    fill join the session's pin (it covered the prompt's blocks only), and stay pinned after
    the request ends."""
    s, w, caches = pair
    toks, gen = list(range(100, 118)), [300, 301, 302, 303, 304, 305]
    req = _request("r1", toks, all_token_ids=list(toks))
    req.kv_transfer_params = {"x-session-affinity": "agent-1"}
    _admit(s, req, [0, 1, 2, 3, 4, 5])
    _step(s, w, req, [0, 1, 2, 3, 4, 5], 0, 18)
    pins = w.store.index.pins
    assert len(pins.sessions()["agent-1"].keys) == 4
    req.all_token_ids = toks + gen[:3]              # block 4 (tokens 16..19) is whole
    plan = _step(s, w, req, [0, 1, 2, 3, 4, 5], 18, 2, new=False)
    assert [(r.start, r.end) for r in plan.saves] == [(4, 5)]
    want = w.store.keys(toks + gen[:2])             # the prompt's 4 blocks and the answer's first
    s.finished("r1")
    w.finished({"r1"})
    assert pins.sessions()["agent-1"].keys == list(want)
    assert all(pins.floor(k) == 0 for k in want)


def test_session_pin_and_tagged_requests_do_not_share(pair):
    s, w, caches = pair
    toks = list(range(400, 413))
    req = _request("r1", toks)
    req.kv_transfer_params = {"x-session-affinity": "s-1"}
    _admit(s, req, [0, 1, 2, 3])
    _step(s, w, req, [0, 1, 2, 3], 0, 13)
    assert w.store.stats().pinned_sessions == 1
    salted = _request("r2", toks)
    salted.cache_salt = "tenant-b"
    assert s.match(salted, 0) == 0                   # another tenant's chain: no hit
    assert s.match(_request("r3", toks), 0) == 3 * T
    assert s.match(_request("r4", toks[:8]), 0) == T   # at least one token left to compute


@pytest.mark.parametrize("ttl", ["abc", None, [], True, -5, float("inf"), "1e999", 0])
def test_a_clients_bad_session_ttl_is_the_default_not_an_engine_crash(ttl, caplog):
    """x-session-ttl comes from a client's kv_transfer_params and is read in vLLM's engine core:
    "abc" or null raised there and killed the engine for every later request."""
    s = SchedulerSide(parse_config({"pin_ttl": 60}), 16)
    req = _request("r", list(range(100)))
    req.kv_transfer_params = {"x-session-affinity": "a", "x-session-ttl": ttl}
    assert s.match(req, 0) == 0
    assert s._reqs["r"].ttl == 60 and (ttl is None or "x-session-ttl" in caplog.text)
    ok = _request("q", list(range(100)))
    ok.kv_transfer_params = {"x-session-affinity": "a", "x-session-ttl": "30"}
    s.match(ok, 0)
    assert s._reqs["q"].ttl == 30


def test_scheduler_without_workers_reports_no_hits():
    s = SchedulerSide(parse_config({}), 16)
    assert s.match(_request("r", list(range(100))), 0) == 0


def test_connector_class_needs_vllm():
    import importlib.util

    import kvtier.integrations.vllm as integ

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"kvtier\[vllm\]"):
            integ.KvtierConnector
    else:
        assert integ.KvtierConnector.__name__ == "KvtierConnector"
    with pytest.raises(AttributeError):
        integ.NoSuchThing
