"""kvtier.engine.sampling: greedy, temperature, top-p, per-request seeded generators, validation."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.sampling import SamplingParams, cut, make_generator, sample
from kvtier.errors import ConfigError

torch.set_num_threads(1)


def _draw(logits: torch.Tensor, params: SamplingParams, steps: int) -> list[int]:
    """`steps` tokens from one row, with the request's own generator."""
    g = make_generator(params)
    return [int(sample(logits[None], [params], [g])[0]) for _ in range(steps)]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_lowest_id_on_ties() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 31] = 100.0          # a tie: the lower id wins
    p = [SamplingParams()] * 6
    out = sample(logits, p, [make_generator(x) for x in p])
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert out.tolist() == logits.argmax(-1).tolist()
    assert int(out[2]) == 7
    assert make_generator(SamplingParams()) is None


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(64)                       # uniform: every draw is pure RNG
    a = _draw(logits, SamplingParams(temperature=1.0, seed=7), 100)
    b = _draw(logits, SamplingParams(temperature=1.0, seed=7), 100)
    c = _draw(logits, SamplingParams(temperature=1.0, seed=8), 100)
    assert a == b
    assert a != c
    assert len(set(a)) > 30                        # it does sample, not argmax


def test_unseeded_generators_differ() -> None:
    p = SamplingParams(temperature=1.0)
    assert make_generator(p).initial_seed() != make_generator(p).initial_seed()


def test_tiny_top_p_is_argmax() -> None:
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=s) for s in range(8)]
    gens = [make_generator(p) for p in params]
    for _ in range(30):
        logits = torch.randn(8, 40, generator=gen)
        assert sample(logits, params, gens).tolist() == logits.argmax(-1).tolist()


def test_values_that_underflow_float32_are_argmax_not_a_crash() -> None:
    """A temperature of 1e-45 overflowed the float32 logits (inf/nan probabilities: `kvtier
    generate` died, `serve` answered 500) and a top_p of 1e-300 is 0 in float32 (every token
    cut). Both now take the top token."""
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=t, seed=1) for t in (1e-45, 1e-38, 1e-300, 1e-6)]
    params += [SamplingParams(temperature=1.0, top_p=p, seed=1) for p in (1e-300, 1e-46)]
    gens = [make_generator(p) for p in params]
    for _ in range(10):
        logits = torch.randn(len(params), 50, generator=gen) * 30
        assert sample(logits, params, gens).tolist() == logits.argmax(-1).tolist()
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("top_p,support", [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_nucleus_support_and_weights(top_p: float, support: set[int]) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = _draw(probs.log(), SamplingParams(temperature=1.0, top_p=top_p, seed=3), 2000)
    counts = torch.bincount(torch.tensor(draws), minlength=4).float()
    assert {i for i in range(4) if counts[i] > 0} == support
    kept = torch.tensor(sorted(support))
    renorm = probs[kept] / probs[kept].sum()
    if len(kept) > 1:
        assert _chi2(counts[kept], renorm) < 20.0   # df <= 3; p ~ 2e-4


def test_temperature_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    draws = _draw(logits, SamplingParams(temperature=2.0, seed=11), 4000)
    counts = torch.bincount(torch.tensor(draws), minlength=8).float()
    assert _chi2(counts, torch.softmax(logits / 2.0, -1)) < 24.3          # df = 7, p = 0.001
    assert _chi2(counts, torch.softmax(logits, -1)) > 100.0              # temperature really applied


def test_batch_composition_does_not_change_a_seeded_row() -> None:
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(5, 30, generator=gen) for _ in range(20)]
    mine = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    alone = [int(sample(lg[2:3], [mine], [g])[0]) for g in [make_generator(mine)] for lg in steps]

    others = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5, top_p=0.5, seed=2),
              SamplingParams(temperature=2.0, seed=1234)]
    batch_params = [others[0], others[1], mine, others[2], others[3]]
    gens = [make_generator(p) for p in batch_params]
    in_batch = [int(sample(lg, batch_params, gens)[2]) for lg in steps]
    assert in_batch == alone

    # and at another position, next to other rows
    gens = [make_generator(p) for p in (mine, others[3])]
    first = [int(sample(torch.stack([lg[2], lg[0]]), [mine, others[3]], gens)[0]) for lg in steps]
    assert first == alone


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=12), st.floats(0.01, 1.0), st.floats(0.1, 3.0),
       st.integers(0, 2**32))
def test_sampled_token_is_in_the_nucleus(logits: list[float], top_p: float, temp: float, seed: int) -> None:
    lg = torch.tensor(logits)
    p = SamplingParams(temperature=temp, top_p=top_p, seed=seed)
    probs = torch.softmax(lg / temp, -1)
    for t in _draw(lg, p, 5):
        more_likely = float(probs[probs > probs[t]].sum())
        assert more_likely < top_p + 1e-5


def test_none_generator_uses_default_rng() -> None:
    out = sample(torch.zeros(3, 10), [SamplingParams(temperature=1.0)] * 3, [None] * 3)
    assert out.shape == (3,) and all(0 <= t < 10 for t in out.tolist())


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"max_tokens": True},
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -1.0},
    {"seed": 1.0}, {"seed": "7"}, {"seed": -1}, {"seed": 2**64},
    {"stop_token_ids": (1, -2)}, {"stop_token_ids": ("a",)}, {"ignore_eos": "yes"},
])
def test_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_valid_params_normalise_stop_ids() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.7, top_p=1, seed=0, stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.stop_token_ids == (3, 4) and not p.greedy and SamplingParams().greedy


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ConfigError, match="one SamplingParams"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])
    with pytest.raises(ConfigError, match="batch, vocab"):
        sample(torch.zeros(5), [SamplingParams()], [None])


# -- top_k and min_p, as vLLM defines them ---------------------------------------------------------

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


def _counts(params: SamplingParams, steps: int = 2000) -> torch.Tensor:
    return torch.bincount(torch.tensor(_draw(PROBS.log(), params, steps)), minlength=len(PROBS))


@pytest.mark.parametrize("top_k,kept", [(1, 1), (2, 2), (3, 3), (5, 5), (99, 5), (0, 5), (-1, 5)])
def test_top_k_samples_from_the_k_most_likely_in_proportion(top_k: int, kept: int) -> None:
    counts = _counts(SamplingParams(temperature=1.0, top_k=top_k, seed=1))
    assert counts[kept:].sum() == 0 and (counts[:kept] > 0).all()
    if kept > 1:
        assert _chi2(counts[:kept].float(), PROBS[:kept] / PROBS[:kept].sum()) < 20


@pytest.mark.parametrize("min_p,kept", [(0.0, 5), (0.2, 4), (0.3, 3), (0.5, 2), (0.76, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_top_tokens_probability(min_p: float, kept: int) -> None:
    counts = _counts(SamplingParams(temperature=1.0, min_p=min_p, seed=2))
    assert counts[kept:].sum() == 0 and (counts[:kept] > 0).all()


def test_top_k_ties_with_the_kth_token_are_kept() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0]).log()        # the 2nd and 3rd tie
    counts = torch.bincount(torch.tensor(_draw(logits, SamplingParams(temperature=1.0, top_k=2, seed=3), 500)),
                            minlength=4)
    assert counts[3] == 0 and (counts[:3] > 0).all()


def test_top_p_cuts_what_top_k_kept_renormalised() -> None:
    """top-k 2 keeps 0.4 and 0.3 (4/7 and 3/7 of what is left): top-p 0.5 then keeps the first alone."""
    assert set(_draw(PROBS.log(), SamplingParams(temperature=1.0, top_k=2, top_p=0.5, seed=4), 300)) == {0}
    assert set(_draw(PROBS.log(), SamplingParams(temperature=1.0, top_p=0.5, seed=4), 300)) == {0, 1}


def test_top_k_and_min_p_cut_their_own_row_only() -> None:
    logits = PROBS.log().repeat(3, 1)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=5), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, min_p=0.5, seed=5)]
    gens = [make_generator(p) for p in params]
    rows = torch.stack([sample(logits, params, gens) for _ in range(1000)])
    assert set(rows[:, 0].tolist()) == {0} and set(rows[:, 1].tolist()) == {0, 1, 2, 3, 4}
    assert set(rows[:, 2].tolist()) == {0, 1}


@pytest.mark.parametrize("kw", [{"top_k": -2}, {"top_k": 1.5}, {"top_k": True}, {"top_k": None},
                                {"min_p": -0.1}, {"min_p": 1.01}, {"min_p": float("nan")}, {"min_p": True}])
def test_bad_top_k_or_min_p_is_a_config_error(kw: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        SamplingParams(temperature=1.0, **kw)


def test_speculative_verification_draws_from_what_top_k_and_min_p_keep() -> None:
    """spec/verify.py's target distribution is sample()'s, cut the same way (it was cut by
    top-p only, so a speculating request could emit a token top_k or min_p drops)."""
    from kvtier.engine.spec.verify import target_probs
    logits = PROBS.log()[None, :].repeat(2, 1)
    for params in (SamplingParams(temperature=1.0, top_k=2, num_speculative_tokens=3),
                   SamplingParams(temperature=1.0, min_p=0.5, top_p=0.9, num_speculative_tokens=3)):
        p = target_probs(logits, params)
        kept = cut(torch.softmax(logits, dim=-1), [params, params])
        assert torch.allclose(p, kept / kept.sum(dim=-1, keepdim=True))
        assert (p[0] > 0).sum() == 2 and torch.allclose(p.sum(dim=-1), torch.ones(2))   # of 5 tokens


@pytest.mark.parametrize("stops", [[1, True], [True, 1], [1, 1.0], [[1]], [1, None]])
def test_stop_ids_are_checked_before_they_are_made_unique(stops):
    """True == 1 and 1.0 == 1: made unique first, [1, True] was taken as (1,) and [[1]] raised
    a TypeError (unhashable), not a ConfigError."""
    with pytest.raises(ConfigError, match="stop_token_ids must be token ids"):
        SamplingParams(stop_token_ids=stops)


def test_vllm_fields_it_lacks_and_misspellings_are_config_errors():
    """SamplingParams(n=2) or (stop=[...]) was a bare TypeError ("unexpected keyword")."""
    import dataclasses
    import pickle

    import pytest

    from kvtier.engine import SamplingParams
    from kvtier.errors import ConfigError
    with pytest.raises(ConfigError, match="no 'n': one sequence per request"):
        SamplingParams(n=2)
    with pytest.raises(ConfigError, match="no 'stop': .* give stop_token_ids"):
        SamplingParams(stop=["</tool>"])
    with pytest.raises(ConfigError, match="did you mean 'max_tokens'"):
        SamplingParams(max_token=3)
    p = SamplingParams(max_tokens=3, seed=1, stop_token_ids=(5,))
    assert dataclasses.replace(p, max_tokens=4).max_tokens == 4 and pickle.loads(pickle.dumps(p)) == p
