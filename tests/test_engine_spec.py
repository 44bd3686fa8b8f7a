"""Speculative decoding on kimi-tiny: greedy tokens equal those without it (batched,
chunked, cached, preempted), drafts are accepted when the output repeats the context,
published blocks hold only accepted tokens' KV, and the rejection rule samples the target."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtier import StoreConfig
from kvtier.cli import main
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.spec import SpeculativeConfig
from kvtier.engine.spec.ngram import NgramProposer
from kvtier.engine.spec.verify import accept_greedy, accept_sampled
from kvtier.errors import ConfigError

torch.set_num_threads(1)
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# Published blocks of a speculative run vs a plain one: the verify step computes 1 + k tokens
# where plain decoding computes 1, so the same tokens' KV goes through other matmul shapes
# (and the masked attention path): equal within fp32 rounding, not byte for byte.
KV_ATOL = 1e-4


def tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(256) for _ in range(n)]


def engine(spec: SpeculativeConfig | None, *, copying: bool = False, **kw) -> LLM:
    """kimi-tiny; `copying` zeroes every attention output projection, so the next token is a
    function of the current one (a bigram model over random weights): its greedy output
    cycles and repeats its context, which random weights never do by themselves. Attention
    still reads and writes the KV pages."""
    kw.setdefault("cache", StoreConfig(host_capacity=None))
    llm = LLM("kimi-tiny", speculative=spec, **kw)
    if copying:
        with torch.no_grad():
            for layer in llm.model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
    return llm


def run(spec: SpeculativeConfig | None, prompts: list, params=GREEDY, *, copying: bool = False, **kw):
    with engine(spec, copying=copying, **kw) as llm:
        outs = llm.generate(prompts, params)
        return [o.token_ids for o in outs], llm.stats(), published(llm.store)


def published(store) -> dict[bytes, np.ndarray]:
    """Every block in a store, read back through the store: key -> its KV (float32)."""
    keys = store.cached_keys()
    rows = np.empty((len(keys), store.layout.block_bytes), np.uint8)
    if keys:
        store.get(keys, rows)
    return {bytes(k): rows[i].view(np.float32) for i, k in enumerate(keys)}


def same_blocks(a: dict, b: dict) -> float:
    """The max |difference| between two runs' blocks; they must hold the same keys."""
    assert a.keys() == b.keys() and a
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def test_greedy_tokens_equal_with_and_without_speculation_batched_chunked_and_cached():
    prompts = [tokens(10 + i, n) for i, n in enumerate((70, 33, 120, 5))] + [list(b"abcabcabc" * 6)]
    want, _, _ = run(None, prompts, max_batched_tokens=24)
    with engine(SPEC, max_batched_tokens=24) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        again = llm.generate(prompts, GREEDY)                  # second run: prefixes from the store
        assert [o.token_ids for o in again] == want
        assert all(o.cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
        assert llm.stats()["spec"]["drafts"] > 0


@pytest.fixture(scope="module")
def cycle() -> list[int]:
    """A prompt that ends in the copying model's own greedy cycle: its output repeats the prompt."""
    with engine(None, copying=True) as llm:
        return tokens(1, 8) + llm.generate([tokens(1, 8)], SamplingParams(max_tokens=80, ignore_eos=True))[0].token_ids


def test_drafts_are_accepted_when_the_output_repeats_the_prompt(cycle):
    prompt = cycle
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want, _, plain = run(None, [prompt, tokens(2, 30)], params, copying=True)
    got, stats, spec = run(SPEC, [prompt, tokens(2, 30)], params, copying=True)
    assert got == want
    st = stats["spec"]
    assert st["accepted_tokens"] > 0 and st["mean_acceptance_length"] > 1
    assert st["mean_acceptance_length"] == pytest.approx(1 + st["accepted_tokens"] / st["drafts"])
    assert sum(st["accepted_per_position"]) == st["accepted_tokens"] <= st["draft_tokens"]
    assert same_blocks(spec, plain) <= KV_ATOL


def test_speculation_per_request(cycle):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    with engine(SPEC, copying=True) as llm:
        off = llm.generate([cycle], SamplingParams(max_tokens=30, ignore_eos=True, num_speculative_tokens=0))[0]
        assert llm.stats()["spec"]["drafts"] == 0
        two = llm.generate([cycle], SamplingParams(max_tokens=30, ignore_eos=True, num_speculative_tokens=2))[0]
        st = llm.stats()["spec"]
        assert st["drafts"] > 0 and len(st["accepted_per_position"]) == 2 and two.token_ids == off.token_ids
        assert llm.generate([cycle], params)[0].token_ids == off.token_ids
        many = llm.generate([cycle], SamplingParams(max_tokens=30, ignore_eos=True, num_speculative_tokens=50))[0]
        st = llm.stats()["spec"]
        assert many.token_ids == off.token_ids and len(st["accepted_per_position"]) == 4   # the engine's k at most
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


class Oracle:
    """Proposes the true continuation with one token wrong at a position that varies from step
    to step (and sometimes none): rejected drafts' KV lands on every offset of a page, the
    last one included, and some steps accept everything (the worst case for the store)."""

    def __init__(self, prompt: list[int], continuation: list[int]) -> None:
        self.truth = prompt + continuation

    def propose(self, toks, k):
        n = len(toks)
        draft = list(self.truth[n:n + k])
        wrong = (n * 7) % (k + 2)
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % 256
        return draft


def test_published_blocks_hold_only_accepted_tokens_kv():
    prompt = tokens(3, 45)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want, _, plain = run(None, [prompt], params)
    with engine(SPEC) as llm:
        llm.proposer = Oracle(prompt, want[0])
        out = llm.generate([prompt], params)[0]
        st, spec = llm.stats()["spec"], published(llm.store)
    assert out.token_ids == want[0]
    assert st["accepted_tokens"] > 0 and st["accepted_tokens"] < st["draft_tokens"]
    assert len(spec) == (len(prompt) + len(want[0]) - 1) // 16       # every full block, nothing past
    assert same_blocks(spec, plain) <= KV_ATOL


def test_preemption_with_speculation_changes_no_token():
    bb = 40960                                                # kimi-tiny's block at 16 tokens
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [tokens(30, 64), tokens(31, 64)]
    cache = StoreConfig(device_capacity=9 * bb, host_capacity="8MiB")
    want, _, _ = run(None, prompts, params, copying=True, cache=cache)
    got, stats, _ = run(SPEC, prompts, params, copying=True, cache=cache)
    assert got == want and stats["preemptions"] > 0


def test_sampled_requests_run_with_speculation(cycle):
    hot = SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9, seed=3, ignore_eos=True)   # near greedy: it cycles
    with engine(SPEC, copying=True) as llm:
        a, b = llm.generate([cycle, cycle], [hot, hot])
        assert a.token_ids == b.token_ids and len(a.token_ids) == 30     # seeded: reproducible
        assert llm.stats()["spec"]["accepted_tokens"] > 0


def test_rejection_sampling_gives_the_target_distribution():
    """A point-mass draft accepted with p(d), else a draw from p without d: the first token's
    law is p; after an accepted d1, the second's is the next row's p."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    n = 40000
    first = np.zeros(4)
    second = np.zeros(4)
    for _ in range(n):
        out, acc = accept_sampled(p, [2, 0], g)
        first[out[0]] += 1
        if acc >= 1:
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        m = counts.sum()
        sd = np.sqrt(m * probs.numpy() * (1 - probs.numpy()))
        assert np.all(np.abs(counts - m * probs.numpy()) < 5 * sd), (counts / m, probs)
    assert second.sum() == pytest.approx(n * 0.3, rel=0.05)     # d1 = 2 accepted with p0(2)
    # Certain drafts are always accepted, impossible ones never.
    sure = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])
    assert accept_sampled(sure, [1, 0], g)[1] == 2
    assert accept_sampled(sure, [0, 0], g) == ([1], 0)


def test_greedy_acceptance_and_the_ngram_proposer():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert accept_greedy(logits, [1, 0]) == ([1, 0, 2], 2)
    assert accept_greedy(logits, [1, 2]) == ([1, 0], 1)
    assert accept_greedy(logits, [2, 0]) == ([1], 0)
    ng = NgramProposer(1, 3)
    assert ng.propose([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]               # "2 3" matched, then what followed
    assert ng.propose([1, 2, 3, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]    # the most recent match
    assert ng.propose([5, 6, 7, 8], 3) == []                            # nothing repeats
    assert ng.propose([7, 7], 4) == [7]
    assert NgramProposer(2, 3).propose([1, 2, 3, 9, 3], 2) == []         # a 1-gram match is too short


def test_speculative_config_and_cli(capsys):
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3
    for bad, why in (("{bad", "not valid JSON"), ('{"method": "eagle"}', "method"), ("[1]", "JSON object"),
                     ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
                     ('{"method": "ngram", "k": 2}', "unknown"),
                     ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "<=")):
        with pytest.raises(ConfigError, match=why):
            SpeculativeConfig.from_json(bad)
        assert main(["generate", "--prompt", "x", "--speculative-config", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvtier: error:"), err
    with pytest.raises(ConfigError, match="SpeculativeConfig"):
        LLM("kimi-tiny", speculative={"method": "ngram"})
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    assert main(["generate", "--prompt", "abcabcabcabc", "--max-tokens", "8", "--json",
                 "--speculative-config", spec]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 8 and out["spec"]["mean_acceptance_length"] >= 1


def test_bench_engine_speculative(capsys):
    import json
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert main(["bench", "engine", "--speculative", spec, "--decode-tokens", "4", "--batch", "1", "--json",
                 "--repeat", "1", "--spec-prompts", "tool"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["speculative"] for r in rows] == ["off", "ngram k=2"] and all(r["tokens"] == 3 for r in rows)
    assert rows[1]["mean_acceptance_length"] >= 1
    draft = '{"method": "draft_model", "model": "kimi-tiny", "num_speculative_tokens": 3}'
    assert main(["bench", "engine", "--speculative", draft, "--decode-tokens", "9", "--batch", "2", "--json",
                 "--repeat", "1", "--spec-prompts", "text"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompts"], r["speculative"]) for r in rows] == [("text", "off"), ("text", "draft_model k=3")]
    assert rows[1]["accepted_tokens"] > 0 and rows[1]["mean_acceptance_length"] > 1   # the draft is the target
    assert main(["bench", "engine", "--speculative", "{"]) == 2
    assert capsys.readouterr().err.startswith("kvtier: error:")


def test_kvtier_serve_with_speculation_streams_the_plain_greedy_tokens(capsys):
    pytest.importorskip("uvicorn")
    from test_serve import Server
    prompt = "".join(chr(c) for c in range(32, 127))         # every printable byte: output tokens find matches
    with LLM("kimi-tiny", cache=StoreConfig(device_capacity="4MiB", host_capacity=None)) as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    srv = Server("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    try:
        stream = srv.wait_ready().client().completions.create(
            model="kimi-tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream) == want
        got = srv.metrics()
        assert got["kvtier:spec_decode_num_drafts_total"][()] > 0
        assert "kvtier:spec_decode_num_accepted_tokens_per_pos_total" in got
    finally:
        srv.stop()
    assert main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error:") and "num_speculative_tokens" in err[0]


# -- draft model ------------------------------------------------------------------------
DRAFT = SpeculativeConfig(method="draft_model", model="kimi-tiny", num_speculative_tokens=4)


def perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Seeded noise on the dense layer's MLP: a draft close to the target, so some drafts are
    accepted and some rejected (kimi-tiny itself as the draft would accept every one)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = model.model.layers[0].mlp.down_proj.weight
        w += (torch.randn(w.shape, generator=g) * scale).to(w.device)


def test_draft_model_greedy_tokens_equal_batched_chunked_and_cached():
    prompts = [tokens(10 + i, n) for i, n in enumerate((70, 33, 120, 5))] + [list(b"abcabcabc" * 6)]
    want, _, _ = run(None, prompts, max_batched_tokens=24)
    with engine(DRAFT, max_batched_tokens=24) as llm:
        perturb(llm.proposer.model)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        st = llm.stats()["spec"]
        assert 0 < st["accepted_tokens"] < st["draft_tokens"]               # rejections happened
        draft_store = llm.proposer.adapter.store
        hits = draft_store.stats().counters.lookup_hit_blocks
        again = llm.generate(prompts, GREEDY)                  # second run: prefixes from both stores
        assert [o.token_ids for o in again] == want
        assert all(o.cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
        assert draft_store.stats().counters.lookup_hit_blocks > hits        # the draft's own prefix cache
        assert not llm.proposer.seqs                                         # finished: draft pages freed
        assert not draft_store.pages.owned() and not draft_store.pages.referenced()


@pytest.mark.parametrize("budget, pages", [(2, None), (64, 16)])
def test_draft_model_whose_drafts_the_scheduler_cut_changes_no_token(budget, pages):
    """A token budget or pages too small for every draft: the scheduler cuts drafts the draft
    model has already fed. Where the target then accepted all it saw, the draft's state
    counted the request's last token as computed and the next proposal was a batch of 0
    tokens ("bad SeqSlice(..., num_new=0, ...)")."""
    prompts = [tokens(50 + i, n) for i, n in enumerate((5, 40, 1, 120, 17, 60, 9, 33))]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    cache = StoreConfig(host_capacity=None, **({"device_capacity": pages * 40960} if pages else {}))
    want, _, _ = run(None, prompts, params)
    with engine(DRAFT, max_batched_tokens=budget, cache=cache) as llm:       # kimi-tiny drafts for itself
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.stats()["spec"]["accepted_tokens"] > 0


def test_draft_model_preemption_changes_no_token():
    bb = 40960
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [tokens(30, 64), tokens(31, 64)]
    cache = StoreConfig(device_capacity=9 * bb, host_capacity="8MiB")
    want, _, _ = run(None, prompts, params, cache=cache)
    with engine(DRAFT, cache=cache) as llm:
        perturb(llm.proposer.model)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert got == want and llm.stats()["preemptions"] > 0 and llm.stats()["spec"]["accepted_tokens"] > 0


def test_draft_model_publishes_only_accepted_tokens_kv():
    """The target's blocks equal a plain run's; the draft's own blocks equal what the (same,
    perturbed) draft model computes for those tokens by plain prefill: no rejected draft in either."""
    prompt = tokens(3, 45)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want, _, plain = run(None, [prompt], params)
    with engine(DRAFT) as llm:
        perturb(llm.proposer.model)
        out = llm.generate([prompt], params)[0]
        st, spec = llm.stats()["spec"], published(llm.store)
        draft_blocks = published(llm.proposer.adapter.store)
    assert out.token_ids == want[0] and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert same_blocks(spec, plain) <= KV_ATOL
    with engine(None) as ref:                                   # the draft model alone, over the same tokens
        perturb(ref.model)
        ref.generate([prompt + out.token_ids], SamplingParams(max_tokens=1))
        ref_blocks = published(ref.store)
    assert draft_blocks and draft_blocks.keys() <= ref_blocks.keys()
    assert same_blocks(draft_blocks, {k: ref_blocks[k] for k in draft_blocks}) <= KV_ATOL


def test_draft_model_sampled_requests_are_seeded_and_accept_an_identical_draft():
    hot = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    with engine(DRAFT) as llm:                                  # draft = target: p = q, nothing to reject
        a, b = llm.generate([tokens(4, 20), tokens(4, 20)], [hot, hot])
        st = llm.stats()["spec"]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert st["acceptance_rate"] > 0.9


def test_rejection_sampling_with_a_draft_distribution_gives_the_target_distribution():
    """Drafts drawn from q, accepted with min(1, p/q), else a draw from max(0, p - q): the first
    token's law is p0 and, after an accepted first draft, the second's is p1."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    g = torch.Generator().manual_seed(0)
    n = 20000
    d = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(2)], 1).tolist()
    first, second, accepted = np.zeros(4), np.zeros(4), 0
    for d1, d2 in d:
        out, acc = accept_sampled(p, [d1, d2], g, q)
        first[out[0]] += 1
        if acc >= 1:
            accepted += 1
            second[out[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        m = counts.sum()
        sd = np.sqrt(m * probs.numpy() * (1 - probs.numpy()))
        assert np.all(np.abs(counts - m * probs.numpy()) < 5 * sd), (counts / m, probs)
    # P(accept d1) = sum_x min(p0(x), q0(x)) = 0.1 + 0.2 + 0.2 + 0.1
    assert accepted / n == pytest.approx(0.6, abs=5 * np.sqrt(0.24 / n))
    same = accept_sampled(p[:2], [3], g, p[:1])                 # q = p: always accepted
    assert same[1] == 1


def test_draft_model_config_errors(tmp_path, capsys):
    from kvtier.engine.config import preset
    from kvtier.engine.weights import random_weights, save_checkpoint
    with pytest.raises(ConfigError, match="needs \"model\""):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ConfigError, match="draft_model"):
        SpeculativeConfig(method="ngram", model="kimi-tiny")
    small = preset("kimi-tiny").replace(vocab_size=300, num_hidden_layers=1, first_k_dense_replace=1)
    save_checkpoint(tmp_path, small, random_weights(small))
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM("kimi-tiny", cache=StoreConfig(device_capacity="4MiB", host_capacity=None),
            speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path)))
    bad = '{"method": "draft_model", "model": "/no/such/dir"}'
    assert main(["generate", "--prompt", "x", "--speculative-config", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error:"), err


# -- MTP (DeepSeek-V3's next-token-prediction layer) ---------------------------------------
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=3)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A 1-layer DeepSeek-V3 checkpoint with an MTP layer, built so the MTP layer predicts what
    the target will: attention outputs are zero (the target is a bigram model, next = f(token)),
    embedding rows have unit RMS (enorm is the identity on them), eh_proj keeps the embedding
    half only, and the MTP block is a copy of layer 0: MTP(h_i, token i+1) = f(token i+1)."""
    from kvtier.engine.config import preset
    from kvtier.engine.weights import random_weights, save_checkpoint
    cfg = preset("deepseek-tiny").replace(num_hidden_layers=1, first_k_dense_replace=0)
    state = random_weights(cfg, seed=3)
    emb = state["model.embed_tokens.weight"]
    emb /= emb.pow(2).mean(-1, keepdim=True).sqrt()
    state["model.layers.1.embed_tokens.weight"] = emb.clone()
    for name in [k for k in state if k.startswith("model.layers.0.")]:
        state[name.replace("layers.0.", "layers.1.")] = state[name].clone()
    for layer in (0, 1):
        state[f"model.layers.{layer}.self_attn.o_proj.weight"].zero_()
    h = cfg.hidden_size
    state["model.layers.1.eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
    path = tmp_path_factory.mktemp("mtp")
    save_checkpoint(path, cfg, state)
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(cfg.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def mtp_engine(path: str, spec: SpeculativeConfig | None, noise: float = 0.0, **kw) -> LLM:
    """The checkpoint's engine; noise > 0 perturbs the MTP layer's eh_proj so some drafts are rejected."""
    kw.setdefault("cache", StoreConfig(host_capacity=None))
    llm = LLM(path, speculative=spec, **kw)
    if noise:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            w = llm.model.model.layers[1].eh_proj.weight
            w += (torch.randn(w.shape, generator=g) * noise).to(w.device)
    return llm


def test_a_tiny_checkpoint_with_an_mtp_layer_round_trips(mtp_checkpoint, tmp_path):
    from kvtier.engine.model import load_model
    from kvtier.engine.weights import load_checkpoint
    with_mtp = load_checkpoint(mtp_checkpoint, mtp=True)
    assert "model.layers.1.eh_proj.weight" in with_mtp and "model.layers.1.shared_head.head.weight" in with_mtp
    plain = load_checkpoint(mtp_checkpoint)
    assert not any(k.startswith("model.layers.1.") for k in plain)           # skipped unless asked for
    model, _ = load_model(mtp_checkpoint, mtp=True)
    assert model.kv_layout(16).num_layers == 2 and "mtp=1" in model.kv_layout(16).variant
    assert torch.equal(model.model.layers[1].eh_proj.weight.cpu(), with_mtp["model.layers.1.eh_proj.weight"])
    with pytest.raises(ConfigError, match="MTP"):
        LLM("kimi-tiny", cache=StoreConfig(device_capacity="4MiB", host_capacity=None), speculative=MTP)


def test_mtp_greedy_tokens_equal_batched_chunked_cached_and_preempted(mtp_checkpoint):
    prompts = [tokens(10 + i, n) for i, n in enumerate((70, 33, 120, 5))]
    with mtp_engine(mtp_checkpoint, None, max_batched_tokens=24) as llm:
        want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with mtp_engine(mtp_checkpoint, MTP, noise=0.02, max_batched_tokens=24) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        st = llm.stats()["spec"]
        assert 0 < st["accepted_tokens"] < st["draft_tokens"]
        again = llm.generate(prompts, GREEDY)                    # prefixes (and their MTP KV) from the store
        assert [o.token_ids for o in again] == want
        assert all(o.cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
        assert llm.stats()["spec"]["accepted_tokens"] > st["accepted_tokens"]
    bb = 16 * (128 + 32) * 4                                      # one layer of a block: 16 tokens, fp32
    cache = StoreConfig(device_capacity=9 * 2 * bb, host_capacity="8MiB")      # 9 blocks of 2 layers
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    two = [tokens(30, 64), tokens(31, 64)]
    with mtp_engine(mtp_checkpoint, None, cache=StoreConfig(device_capacity=9 * bb, host_capacity="8MiB")) as llm:
        want = [o.token_ids for o in llm.generate(two, params)]
    with mtp_engine(mtp_checkpoint, MTP, noise=0.02, cache=cache) as llm:
        assert [o.token_ids for o in llm.generate(two, params)] == want
        assert llm.stats()["preemptions"] > 0 and llm.stats()["spec"]["accepted_tokens"] > 0


def test_mtp_publishes_only_accepted_tokens_kv(mtp_checkpoint):
    """Blocks (the MTP layer's KV included) equal those of the same engine drafting nothing."""
    prompt = tokens(3, 45)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    with mtp_engine(mtp_checkpoint, MTP, noise=0.02) as llm:
        ref = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, num_speculative_tokens=0))[0]
        plain = published(llm.store)
    with mtp_engine(mtp_checkpoint, MTP, noise=0.02) as llm:
        out = llm.generate([prompt], params)[0]
        st, spec = llm.stats()["spec"], published(llm.store)
    assert out.token_ids == ref.token_ids and 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert len(spec) == (len(prompt) + len(out.token_ids) - 1) // 16
    assert same_blocks(spec, plain) <= KV_ATOL


def test_mtp_sampled_requests_are_seeded(mtp_checkpoint):
    hot = SamplingParams(max_tokens=24, temperature=0.05, seed=5, ignore_eos=True)   # near greedy: drafts hit
    with mtp_engine(mtp_checkpoint, MTP) as llm:
        a, b = llm.generate([tokens(4, 20), tokens(4, 20)], [hot, hot])
        st = llm.stats()["spec"]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24 and st["accepted_tokens"] > 0


def test_a_draft_that_fails_to_build_closes_its_own_store(monkeypatch):
    """LLM() closes what it built when a draft fails; the draft's own store (its device
    pages) was left open when the draft's runner failed after the store was made."""
    from kvtier.engine.spec import draft as dmod
    from kvtier.store import Store

    built: list[Store] = []
    real_build = StoreConfig.build

    def spy(self, *a, **k):
        built.append(real_build(self, *a, **k))
        return built[-1]

    def broken_runner(*a, **k):
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(StoreConfig, "build", spy)
    monkeypatch.setattr(dmod, "ModelRunner", broken_runner)
    with pytest.raises(RuntimeError, match="out of device memory"):
        LLM("kimi-tiny", speculative=DRAFT)
    assert len(built) == 2 and all(s._closed for s in built)   # the target's store and the draft's
