"""The disaggregation model (kvtier/sim/disagg.py) and its calibration on the reference
engine (kvtier/sim/calibrate.py): the effects it exists to show follow from its costs."""
from __future__ import annotations

import dataclasses

import pytest

from kvtier.errors import ConfigError
from kvtier.sim.disagg import GPU_KIMI_K2, Costs, Workload, compare, simulate

LOAD = Workload(rate=4, prompt_tokens=8000, output_tokens=200, requests=150)


def test_prefill_chunks_stretch_colocated_decode_steps_and_disaggregation_removes_them():
    colocated, disagg = compare(GPU_KIMI_K2, LOAD, workers=2)
    step = GPU_KIMI_K2.decode_base_s * 1e3
    chunk = GPU_KIMI_K2.prefill_per_token_s * GPU_KIMI_K2.chunk * 1e3
    assert colocated["itl_p99_ms"] > step + chunk / 2          # the tail is a step that carried a chunk
    assert disagg["itl_p99_ms"] < step * 1.5                   # decode-only steps at every percentile
    assert disagg["ttft_p50_ms"] > colocated["ttft_p50_ms"]    # paid for in TTFT (half the workers prefill)


def test_free_prefill_leaves_nothing_to_separate():
    free = dataclasses.replace(GPU_KIMI_K2, prefill_per_token_s=0.0)
    colocated, disagg = compare(free, LOAD, workers=2)
    assert colocated["itl_p90_ms"] == pytest.approx(disagg["itl_p90_ms"], rel=0.1)


def test_the_kv_transfer_shows_in_ttft_only_when_disaggregated():
    slow = dataclasses.replace(GPU_KIMI_K2, link_bytes_per_s=1e9)     # 8000 tokens x 70 KB: ~0.56 s
    fast = simulate(GPU_KIMI_K2, dataclasses.replace(LOAD, rate=0.5), 1, 1)
    slowed = simulate(slow, dataclasses.replace(LOAD, rate=0.5), 1, 1)
    moved = LOAD.prompt_tokens * GPU_KIMI_K2.kv_bytes_per_token / 1e9 * 1e3
    assert slowed["ttft_p50_ms"] - fast["ttft_p50_ms"] == pytest.approx(moved, rel=0.25)
    assert simulate(slow, LOAD, 0, 2, colocated=True) == simulate(GPU_KIMI_K2, LOAD, 0, 2, colocated=True)


def test_token_aware_placement_matters_when_prompts_vary_and_only_then():
    """Round robin and least-tokens placement are the same for prompts of one length; with
    agents' varied prompts, round robin queues long ones behind each other and the TTFT
    tail grows (ITL is disaggregation's effect, not placement's)."""
    even = [compare(GPU_KIMI_K2, LOAD, workers=2, placement=p) for p in ("round-robin", "tokens")]
    assert [r["itl_p90_ms"] for r in even[0]] == pytest.approx([r["itl_p90_ms"] for r in even[1]], rel=0.05)
    varied = dataclasses.replace(LOAD, requests=300, prompt_spread=1.0)
    rr, tokens = (simulate(GPU_KIMI_K2, varied, 0, 2, colocated=True, placement=p) for p in ("round-robin", "tokens"))
    assert rr["ttft_p99_ms"] > 1.5 * tokens["ttft_p99_ms"]
    assert rr["itl_p90_ms"] == pytest.approx(tokens["itl_p90_ms"], rel=0.1)
    with pytest.raises(ConfigError, match="placement must be one of tokens, round-robin"):
        simulate(GPU_KIMI_K2, LOAD, 1, 1, placement="random")


def test_varied_prompts_spread_around_the_length():
    varied = dataclasses.replace(LOAD, requests=2000, prompt_spread=1.0, rate=0.01)
    # At a trickle nothing queues: TTFT is a prompt's own prefill, so its mean follows the prompts'.
    one = simulate(GPU_KIMI_K2, dataclasses.replace(varied, prompt_spread=0.0), 0, 1, colocated=True)
    many = simulate(GPU_KIMI_K2, varied, 0, 1, colocated=True)
    assert many["ttft_p50_ms"] < one["ttft_p50_ms"] < many["ttft_p99_ms"]


def test_the_model_is_deterministic_for_a_seed():
    assert compare(GPU_KIMI_K2, LOAD) == compare(GPU_KIMI_K2, LOAD)
    assert compare(GPU_KIMI_K2, LOAD) != compare(GPU_KIMI_K2, dataclasses.replace(LOAD, seed=1))


def test_calibration_times_the_engine_here():
    from kvtier.engine import LLM
    from kvtier.sim.calibrate import measure_costs

    m = measure_costs(long=128, short=32, batch=4, decode_tokens=4, repeat=1)
    c = m.costs
    assert isinstance(c, Costs) and c.chunk == 128
    assert set(m.step_s) == {1, 4} and all(t > 0 for t in (*m.prefill_s, *m.step_s.values()))
    # the costs are the lines through what was timed (never negative: timings here are noisy)
    assert c.prefill_per_token_s == pytest.approx(max(0.0, (m.prefill_s[1] - m.prefill_s[0]) / (128 - 32)))
    assert c.decode_per_seq_s == pytest.approx(max(0.0, (m.step_s[4] - m.step_s[1]) / 3))
    assert c.decode_base_s == pytest.approx(max(0.0, m.step_s[1] - c.decode_per_seq_s))
    with LLM("kimi-tiny") as llm:      # the model's own KV bytes per token, not a K2 default
        assert c.kv_bytes_per_token == llm.model.kv_layout(16).block_bytes // 16
    colocated, disagg = compare(c, Workload(rate=1, prompt_tokens=256, output_tokens=8, requests=20))
    assert colocated["requests"] == disagg["requests"] == 20


def test_bench_disagg_predict_prints_the_costs_and_both_setups(monkeypatch, capsys):
    """`kvtier bench disagg --predict`: the measured costs, then colocated and 1P+1D at each
    rate, for the costs measured here and for GPU-scale ones (the timing itself is stubbed:
    test_calibration_times_the_engine_here runs it)."""
    import json

    from kvtier import cli
    from kvtier.sim import calibrate

    here = Costs(prefill_per_token_s=2e-4, decode_base_s=0.008, decode_per_seq_s=3e-4, kv_bytes_per_token=2560,
                 chunk=1024)
    monkeypatch.setattr(calibrate, "measure_costs",
                        lambda model: calibrate.Measured(here, (64, 1024), (0.02, 0.21), {1: 0.0083, 16: 0.0128}))
    assert cli.main(["bench", "disagg", "--predict", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[0]["prefill_us_per_token"] == 200.0 and lines[0]["decode_step_ms"] == 8.0
    rows = lines[1:]
    assert [(r["costs"], r["setup"]) for r in rows] == [
        (name, setup) for name in ("measured here", "measured here", "GPU_KIMI_K2", "GPU_KIMI_K2")
        for setup in ("colocated", "1P+1D")]
    gpu = [r for r in rows if r["costs"] == "GPU_KIMI_K2" and r["rate"] == 4.0]
    assert gpu[0]["itl_p99_ms"] > 2 * gpu[1]["itl_p99_ms"]
