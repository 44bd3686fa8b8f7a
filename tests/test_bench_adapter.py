"""`kvtier bench adapter`: the engine's pages <-> kvtier's tiers, timed against memcpy."""
import json

import pytest
import torch

from conftest import assert_one_line_error, run_kvtier


def test_rows_for_each_page_size_and_op():
    r = run_kvtier("bench", "adapter", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                   "--prompt-tokens", "256", "--page-tokens", "16,64", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    ops = ["load_into", "save_from", "load_host", "load_disk"]
    assert [(x["op"], x["page_tokens"], x["blocks"]) for x in rows] == \
        [(op, 16, 32) for op in ops] + [(op, 64, 8) for op in ops]
    for x in rows:
        assert x["gbps"] > 0 and x["memcpy_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["memcpy_gbps"]) < 0.01


def test_bad_page_sizes_are_usage_errors():
    assert_one_line_error(run_kvtier("bench", "adapter", "--page-tokens", "0"), 2, "--page-tokens")
    assert_one_line_error(run_kvtier("bench", "adapter", "--page-tokens", "512", "--prompt-tokens", "256"), 2,
                          "no full 512-token page")


def test_device_cpu_is_recorded_with_its_baseline():
    r = run_kvtier("bench", "adapter", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                   "--prompt-tokens", "64", "--page-tokens", "16", "--repeat", "1", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["op"] for x in rows] == ["load_into", "save_from", "load_host", "load_disk"]
    assert {(x["device"], x["baseline"]) for x in rows} == {("cpu", "memcpy")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: --device cuda:0 is valid")
def test_device_cuda_without_cuda_is_a_usage_error():
    assert_one_line_error(run_kvtier("bench", "adapter", "--device", "cuda:0"), 2, "--device cuda:0", "no CUDA",
                          "--device cpu")


def test_bad_device_is_a_usage_error():
    assert_one_line_error(run_kvtier("bench", "adapter", "--device", "tpu"), 2, "--device")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")
def test_on_a_gpu_each_op_has_its_dma_baseline():
    r = run_kvtier("bench", "adapter", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                   "--prompt-tokens", "64", "--page-tokens", "16", "--repeat", "1", "--device", "cuda:0", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["op"], x["baseline"]) for x in rows] == [
        ("load_into", "pinned host->device"), ("save_from", "device->pinned host"),
        ("load_host", "pinned host->device"), ("load_disk", "pinned host->device")]
    assert all(x["device"].startswith("cuda:0 (") for x in rows)
