"""The reference engine end to end on kimi-tiny: cached prefixes from every tier give the
same greedy tokens as computing them, batching/chunking/preemption change nothing, the
API, the CLI and the benchmark run."""
from __future__ import annotations

import json
import random

import time

import pytest
import torch

from kvtier.cli import main
from kvtier import StoreConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.errors import ClosedError, ConfigError

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BT = 16


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(256) for _ in range(n)]


@pytest.fixture(scope="module")
def block_bytes() -> int:
    with LLM("kimi-tiny", cache=StoreConfig(device_capacity="4MiB", host_capacity=None)) as llm:
        return llm.store.layout.block_bytes


@pytest.fixture(scope="module")
def reference() -> dict:
    """Greedy outputs computed with nothing cached (a fresh engine per prompt)."""
    memo: dict = {}

    def get(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params)
        if key not in memo:
            with LLM("kimi-tiny", cache=StoreConfig(host_capacity=None)) as llm:
                out = llm.generate([prompt], params)[0]
                assert out.cached_tokens == 0
                memo[key] = out.token_ids
        return memo[key]
    return {"get": get}


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_greedy_output_with_a_cached_prefix_equals_it_without(tmp_path, block_bytes, reference, tier):
    shared = tokens(1, 100)
    first, second = shared + tokens(2, 20), shared + tokens(3, 20)
    pages = 10     # one request's worth: a second request pushes the first one's blocks down
    cache = StoreConfig(device_capacity=(64 if tier == "device" else pages) * block_bytes,
                        host_capacity="16MiB" if tier == "host" else None,
                        disk_path=str(tmp_path / "kv") if tier == "disk" else None, disk_capacity="16MiB")
    with LLM("kimi-tiny", cache=cache) as llm:
        llm.generate([first], GREEDY)
        if tier != "device":
            llm.generate([tokens(4, 130)], GREEDY)
        out = llm.generate([second], GREEDY)[0]
        assert out.cached_tokens == 96                       # 6 full blocks of the 100 shared tokens
        assert out.cached_by_tier.get(tier, 0) > 0, out.cached_by_tier
        assert sum(out.cached_by_tier.values()) == 6
        assert out.token_ids == reference["get"](second)
        # The loaded blocks were published in the device tier: a third request finds them there.
        again = llm.generate([shared + tokens(5, 20)], GREEDY)[0]
        assert again.cached_by_tier == {"device": 6}


def test_a_restarted_engine_finds_the_prefix_on_disk(tmp_path, reference):
    p = tokens(6, 80)
    cache = StoreConfig(host_capacity=None, disk_path=str(tmp_path / "kv"), disk_capacity="16MiB")
    with LLM("kimi-tiny", cache=cache) as llm:
        llm.generate([p], GREEDY)
    with LLM("kimi-tiny", cache=cache) as llm:                # close() flushed; this one recovers
        out = llm.generate([p], GREEDY)[0]
    assert out.cached_by_tier == {"disk": 4} and out.token_ids == reference["get"](p)
    with pytest.raises(ConfigError, match="cannot be used here"):   # other weights: another namespace
        LLM("kimi-tiny", seed=1, cache=cache)


def test_batching_chunking_and_preemption_change_no_token(block_bytes, reference):
    prompts = [tokens(10 + i, n) for i, n in enumerate((70, 33, 120, 5))]
    want = [reference["get"](p) for p in prompts]
    with LLM("kimi-tiny", cache=StoreConfig(host_capacity=None), max_batched_tokens=24) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    # Two 64-token prompts fill 8 of 9 pages; as both decode past a page boundary one must
    # be preempted (its blocks stay cached) and readmitted after the other finishes.
    longer = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [tokens(30, 64), tokens(31, 64)]
    want = [reference["get"](p, longer) for p in prompts]
    with LLM("kimi-tiny", cache=StoreConfig(device_capacity=9 * block_bytes, host_capacity="8MiB")) as llm:
        outs = llm.generate(prompts, longer)
        assert [o.token_ids for o in outs] == want
        assert llm.stats()["preemptions"] > 0 and sum(o.preemptions for o in outs) > 0
        assert all(t.used_blocks <= t.capacity_blocks for t in llm.stats()["store"].tiers)


def test_text_prompts_sampling_and_sessions():
    with LLM("kimi-tiny") as llm:
        out = llm.generate("Hello, kvtier!", SamplingParams(max_tokens=8, ignore_eos=True))[0]
        assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id and len(out.token_ids) == 8
        assert isinstance(out.text, str) and out.finish_reason == "length"
        hot = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
        a, b = llm.generate([tokens(20, 40), tokens(20, 40)], [hot, hot])
        assert a.token_ids == b.token_ids                 # same seed, same tokens
        c = llm.generate([tokens(20, 40)], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))[0]
        assert c.token_ids != a.token_ids
        stop = llm.generate([tokens(20, 40)], SamplingParams(max_tokens=16, stop_token_ids=(a.token_ids[0],),
                                                            temperature=1.0, top_p=0.9, seed=7))[0]
        assert stop.token_ids == a.token_ids[:1] and stop.finish_reason == "stop"
        out = llm.generate([tokens(21, 64)], GREEDY, sessions=["agent-1"])[0]
        st = llm.stats()["store"]
        assert st.pinned_sessions == 1 and sum(t.pinned_blocks for t in st.tiers) == 4
        # every step's host time lands in one of the loop's four phases, and only there
        before = dict(llm.phase_seconds)
        t0 = time.perf_counter()
        llm.generate([tokens(22, 64)], SamplingParams(max_tokens=4, ignore_eos=True))
        spent = {k: llm.phase_seconds[k] - before[k] for k in before}
        assert set(spent) == {"schedule", "prepare", "run", "postprocess"} and all(v > 0 for v in spent.values())
        assert sum(spent.values()) <= time.perf_counter() - t0


def test_two_threads_share_one_engine_one_call_at_a_time(reference):
    """Two threads calling generate() on one LLM failed with unrelated errors (an empty
    deque, a bare AssertionError, "cache: 0 keys but 1 pages") and lost pages for good:
    their calls now run one after the other and each gets its own prompt's tokens."""
    import threading

    prompts = [tokens(40, 48), tokens(41, 48)]
    got: dict[int, list[list[int]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    with LLM("kimi-tiny", cache=StoreConfig(host_capacity=None)) as llm:
        def run(i: int) -> None:
            try:
                for _ in range(3):
                    got[i].append(llm.generate([prompts[i]], GREEDY)[0].token_ids)
            except BaseException as e:       # noqa: BLE001 - any error is the failure
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and llm.pages_in_use == 0
        assert all(out == reference["get"](prompts[i]) for i in range(2) for out in got[i])
        rid = llm.add_request(prompts[0], GREEDY)       # a request generate() would finish and drop
        with pytest.raises(ConfigError, match="queued with add_request"):
            llm.generate([prompts[1]], GREEDY)
        while llm.request(rid) is not None:
            llm.step()


def test_bad_requests_say_what_to_do(block_bytes):
    with LLM("kimi-tiny", cache=StoreConfig(device_capacity=8 * block_bytes, host_capacity=None)) as llm:
        with pytest.raises(ConfigError, match="larger KV cache"):
            llm.generate([tokens(1, 200)], GREEDY)
        with pytest.raises(ConfigError, match="token ids must be ints"):
            llm.generate([[1, 2, 10**6]], GREEDY)
        with pytest.raises(ConfigError, match="empty"):
            llm.generate([[]], GREEDY)
        with pytest.raises(ConfigError, match="3 prompts"):
            llm.generate([[1], [2], [3]], [GREEDY, GREEDY])
    with pytest.raises(ConfigError, match="neither a model preset"):
        LLM("/no/such/checkpoint")
    for bad in (None, 5, ""):                                     # a bare TypeError from pathlib before
        with pytest.raises(ConfigError, match="model must be a preset name"):
            LLM(bad)


def test_bad_engine_arguments_and_prompt_shapes(tmp_path, block_bytes, reference):
    import numpy as np

    cfg = StoreConfig(host_capacity=None, disk_path=str(tmp_path / "d"), disk_capacity="4MiB")
    for kw, match in (({"max_batched_tokens": 0}, "max_batched_tokens must be a whole number >= 1"),
                      ({"max_batched_tokens": "8"}, "max_batched_tokens"), ({"max_batched_tokens": 8.5}, "got 8.5"),
                      ({"max_seqs": 2.5}, "max_seqs"), ({"seed": "1"}, "seed"), ({"seed": True}, "seed"),
                      ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"),
                      ({"dtype": torch.int8}, "dtype must be torch.float32, torch.bfloat16 or torch.float16")):
        with pytest.raises(ConfigError, match=match):
            LLM("kimi-tiny", cache=cfg, **kw)
    # A failed engine leaves nothing open: the disk folder is free for the next one (it was
    # "in use by another store" until the process exited when the tokenizer or the
    # scheduler's checks failed after the store was built).
    from kvtier.engine import llm as llm_module
    real = llm_module.load_tokenizer

    def broken(*a, **k):
        raise ConfigError("no tokenizer today")
    llm_module.load_tokenizer = broken
    try:
        with pytest.raises(ConfigError, match="no tokenizer today"):
            LLM("kimi-tiny", cache=cfg)
    finally:
        llm_module.load_tokenizer = real
    with pytest.raises(ConfigError, match="stop_token_ids must be a list"):
        SamplingParams(stop_token_ids=5)
    ids = tokens(40, 50)
    with LLM("kimi-tiny", cache=cfg) as llm:
        with pytest.raises(ConfigError, match=r"stop_token_ids must be token ids in \[0, "):
            llm.generate([ids], SamplingParams(max_tokens=4, stop_token_ids=[10**9]))
        # named, not the list echoed: a client's list of a million ids came back whole
        with pytest.raises(ConfigError, match=r"got 1000000000$") as e:
            llm.generate([ids], SamplingParams(max_tokens=4, stop_token_ids=[5, 6] * 20_000 + [10**9]))
        assert len(str(e.value)) < 200
        for bad in (5, b"abc", None):
            with pytest.raises(ConfigError, match="prompts must be text, a list of token ids"):
                llm.generate(bad, GREEDY)
        want = reference["get"](ids)
        for one in (np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids]):   # one prompt, not a batch
            (out,) = llm.generate(one, GREEDY)
            assert out.token_ids == want
        assert [o.token_ids for o in llm.generate((p for p in [ids, ids]), GREEDY)] == [want, want]
    with pytest.raises(ClosedError):
        llm.add_request(ids, GREEDY)
    for after_close in (llm.stats, llm.__enter__):            # stale counters, a closed engine handed back
        with pytest.raises(ClosedError):
            after_close()


def test_kvtier_generate_cli(capsys, tmp_path):
    assert main(["generate", "--preset", "kimi-tiny", "--prompt", "The cache", "--prompt", "The cache",
                 "--max-tokens", "5", "--json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(len(r["token_ids"]) <= 5 for r in rows)
    assert main(["generate", "--preset", "kimi-tiny", "--prompt-ids", "1,2,3", "--max-tokens", "3"]) == 0
    assert "random weights" in capsys.readouterr().out
    assert main(["generate", "--preset", "kimi-tiny"]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_kvtier_bench_engine_runs(capsys):
    assert main(["bench", "engine", "--prompt-tokens", "64", "--repeat", "1", "--decode-tokens", "4",
                 "--batch", "1,2", "--json"]) == 0
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    ttft = {r["case"]: r for r in rows if r["bench"] == "engine-ttft"}
    assert set(ttft) == {"device", "host", "disk"}
    for case, r in ttft.items():
        assert r["cached_tokens"] == 48 and r["cached_from"].get(case, 0) > 0, r
    decode = [(r["batch"], r["cuda_graphs"]) for r in rows if r["bench"] == "engine-decode"]
    graphs = ["on", "off"] if torch.cuda.is_available() else ["off"]     # on a GPU: with CUDA graphs and without
    assert decode == [(b, g) for b in (1, 2) for g in graphs]


def test_a_checkpoint_folder_with_its_tokenizer(tmp_path, reference):
    """LLM(path): Hugging Face layout weights (memory-mapped) and tokenizer.json; its cache
    namespace follows the weights, so another checkpoint never hits this one's blocks."""
    pytest.importorskip("safetensors")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from kvtier.engine.config import preset
    from kvtier.engine.weights import random_weights, save_checkpoint

    cfg = preset("kimi-tiny")
    save_checkpoint(tmp_path / "ckpt", cfg, random_weights(cfg, seed=0))
    ids = tokens(40, 50)
    with LLM(str(tmp_path / "ckpt"), cache=StoreConfig(host_capacity=None)) as llm:   # no tokenizer files yet
        out = llm.generate([ids], GREEDY)[0]                            # token ids need none
        assert out.token_ids == reference["get"](ids) and out.text == ""
        with pytest.raises(ConfigError, match="holds no tokenizer.*pass token ids"):
            llm.generate("the agent", GREEDY)
    words = ["<s>", "</s>", "[UNK]", "the", "agent", "calls", "a", "tool", "again"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    with LLM(str(tmp_path / "ckpt")) as llm:
        assert not llm.info.random_weights and llm.info.revision.startswith("ckpt-")
        out = llm.generate("the agent calls a tool again " * 6, GREEDY)[0]
        assert out.prompt_token_ids[:4] == [0, 3, 4, 5]                 # BOS, then the words
        assert isinstance(out.text, str) and len(out.token_ids) == GREEDY.max_tokens
        assert llm.generate([ids], GREEDY)[0].token_ids == reference["get"](ids)   # the same weights as the preset
        assert llm.generate([ids], GREEDY)[0].cached_tokens == 48


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
def test_on_a_gpu_cached_prefixes_from_each_tier_give_the_same_tokens(tmp_path):
    """The same path on CUDA: pages in GPU memory, layer-wise loads from host and disk."""
    shared = tokens(1, 100)
    with LLM("kimi-tiny", device="cuda", cache=StoreConfig(host_capacity=None)) as llm:
        want = llm.generate([shared + tokens(3, 20)], GREEDY)[0].token_ids
        assert llm.adapter.device_tier.on_gpu
        bb = llm.store.layout.block_bytes
    for tier in ("device", "host", "disk"):
        cache = StoreConfig(device_capacity=(64 if tier == "device" else 10) * bb,
                            host_capacity="16MiB" if tier == "host" else None,
                            disk_path=str(tmp_path / tier) if tier == "disk" else None, disk_capacity="16MiB")
        with LLM("kimi-tiny", device="cuda", cache=cache) as llm:
            llm.generate([shared + tokens(2, 20)], GREEDY)
            if tier != "device":
                llm.generate([tokens(4, 130)], GREEDY)
            out = llm.generate([shared + tokens(3, 20)], GREEDY)[0]
            assert out.cached_by_tier.get(tier, 0) > 0 and out.token_ids == want, (tier, out.cached_by_tier)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.mem_get_info()[0] < 64 << 30,
                    reason="needs a CUDA device with 64 GiB free (kimi-medium: 27.4 GiB of weights, more while "
                           "they are stacked): run on a GPU machine, see docs/gpu.md")
def test_on_a_gpu_kimi_medium_runs_and_its_cached_prefix_gives_the_same_tokens():
    """bf16 rounds differently at other matmul shapes, and with random weights greedy tokens
    then part (an H200 run: a 120-token prompt computed whole vs its last 8 tokens over a
    cached prefix, same tokens up to the 9th). So the cold request is computed in the
    chunks the cached one runs: 112 tokens (7 blocks), then 8; the same bits follow."""
    shared = tokens(1, 100)
    with LLM("kimi-medium", device="cuda", max_batched_tokens=112, cache=StoreConfig(host_capacity=None)) as llm:
        assert llm.info.revision == "random-seed0-cuda"
        assert 26 << 30 < torch.cuda.memory_allocated() < 40 << 30
        cold = llm.generate([shared + tokens(3, 20)], GREEDY)[0]
        llm.generate([shared + tokens(2, 20)], GREEDY)
        hot = llm.generate([shared + tokens(3, 20)], GREEDY)[0]
    assert cold.cached_tokens == 0 and hot.cached_tokens == 112 and hot.token_ids == cold.token_ids


def test_the_engine_refuses_another_models_store_and_recovers_from_a_request_it_cannot_fit(block_bytes):
    with LLM("kimi-tiny", cache=StoreConfig(device_capacity=10 * block_bytes, host_capacity=None)) as llm:
        with pytest.raises(ConfigError, match="other weights"):
            LLM("kimi-tiny", seed=1, store=llm.store)
        # A session pins its blocks; a long request then cannot get enough pages: it fails
        # alone, and the engine serves the next request.
        import numpy as np
        llm.generate([np.array(tokens(50, 60))], GREEDY, sessions=["s"])
        with pytest.raises(ConfigError, match="larger KV cache"):
            llm.generate([tokens(51, 140)], GREEDY)
        assert not llm.scheduler.waiting and not llm.scheduler.running
        assert len(llm.generate([tokens(52, 20)], GREEDY)[0].token_ids) == GREEDY.max_tokens
        with pytest.raises(ConfigError, match="ints"):
            llm.generate([[1, True]], GREEDY)


def test_an_engine_never_closed_still_leaves_its_blocks_on_disk(tmp_path, children):
    """The documented script without close(): the store is flushed at interpreter exit."""
    code = ("from kvtier import StoreConfig\nfrom kvtier.engine import LLM, SamplingParams\n"
            f"llm = LLM('kimi-tiny', cache=StoreConfig(host_capacity=None, disk_path={str(tmp_path / 'kv')!r}, disk_capacity='16MiB'))\n"
            "llm.generate([list(range(80))], SamplingParams(max_tokens=2))\n"
            "print('generated', flush=True)\n")
    proc, _ = children(code)
    assert proc.wait(timeout=120) == 0
    with LLM("kimi-tiny", cache=StoreConfig(host_capacity=None, disk_path=str(tmp_path / "kv"), disk_capacity="16MiB")) as llm:
        assert llm.generate([list(range(80))], SamplingParams(max_tokens=2))[0].cached_by_tier == {"disk": 4}
        with pytest.raises(ConfigError, match="one session id"):
            llm.generate(["a"], GREEDY, sessions="s1")
    with pytest.raises(ClosedError, match="LLM is closed"):
        llm.generate(["a"], GREEDY)
    with pytest.raises(ConfigError, match="StoreConfig"):
        LLM("kimi-tiny", cache={"kv_cache": "1GiB"})
    with pytest.raises(ConfigError, match="CUDA"):
        LLM("kimi-tiny", device="cuda:7" if torch.cuda.is_available() else "cuda:0")

