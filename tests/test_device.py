"""Device tier: a slot pool on the GPU, or on a CPU tensor where there is none, that a
Store drives like any other tier."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier
from kvtier.errors import ConfigError
from kvtier.tiers.device import DeviceTier

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


def payload(keys: list[bytes], block_bytes: int) -> torch.Tensor:
    """Bytes derived from each key only, so a load can be checked exactly."""
    return torch.stack([torch.frombuffer(bytearray((k * (block_bytes // 16 + 1))[:block_bytes]), dtype=torch.uint8)
                        for k in keys])


def test_device_none_picks_cuda_or_cpu_and_says_which():
    tier = DeviceTier(blocks=4)
    tier.bind(64)
    info = tier.info()
    assert info["device"] == ("cuda:0" if CUDA else "cpu")
    assert tier.tensor.shape == (4, 64) and tier.tensor.dtype == torch.uint8
    if not CUDA:
        assert info["memory"] == "cpu" and "no CUDA" in info["memory_note"]
    tier.close()


@pytest.mark.skipif(CUDA, reason="checks the error when CUDA is absent")
def test_asking_for_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        DeviceTier(capacity="1MiB", device="cuda:0")
    with pytest.raises(ConfigError, match="device must be"):
        DeviceTier(capacity="1MiB", device="tpu")


def test_a_gpu_tier_larger_than_the_gpus_free_memory_is_refused_before_allocating(monkeypatch):
    """The free memory of the tier's GPU is asked first: one line naming the GPU and what it
    has, no allocation tried (torch's own out-of-memory message spans several lines)."""
    from kvtier.errors import TierSizeError
    tier = DeviceTier(capacity="2GiB", device="cpu")
    tier.device = torch.device("cuda:0")                     # as on a GPU machine, without one
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated despite the check"))
    with pytest.raises(TierSizeError) as e:
        tier._allocate(2048, 1 << 20)
    msg = str(e.value)
    assert "\n" not in msg and "GPU memory (device tier" in msg and "2.00 GiB asked for" in msg, msg
    assert "cuda:0 has 1.00 GiB of memory available (80.00 GiB in all)" in msg, msg
    # memory torch's allocator holds unused (a model's load leaves it there) counts as free

    class Allocated(Exception):
        pass

    def empty(*a, **k):
        raise Allocated
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(Allocated):
        tier._allocate(2048, 1 << 20)


def test_a_demotion_copies_device_slots_straight_into_host_memory():
    """copy_to (what a demotion from a GPU tier runs): the blocks land in the named rows of
    the other tier's memory, whatever order the slots come in, and nothing else is written.
    Run here through the torch path a GPU takes (on a CPU a tier answers False)."""
    tier = DeviceTier(blocks=16, device="cpu")
    tier.bind(64)
    tier.tensor.copy_(torch.arange(16 * 64, dtype=torch.int64).view(16, 64).to(torch.uint8))
    memory = torch.zeros(20, 64, dtype=torch.uint8)
    assert tier.copy_to([3], memory, [0]) is False and not memory.any()     # a CPU tier: blocks() + write()
    tier._np = None                                                          # the GPU's path, on the CPU
    slots, dst = [3, 7, 1, 2, 9], [10, 5, 11, 6, 12]
    assert tier.copy_to(slots, memory, dst) is True
    for s, d in zip(slots, dst):
        assert torch.equal(memory[d], tier.tensor[s])
    assert not memory[[i for i in range(20) if i not in dst]].any()


def test_cpu_slots_are_a_numpy_view_of_the_tensor():
    tier = DeviceTier(blocks=3, device="cpu")
    tier.bind(16)
    rows = np.arange(48, dtype=np.uint8).reshape(3, 16)
    tier.write([2, 0], rows, [0, 2])
    assert torch.equal(tier.tensor[2], torch.from_numpy(rows[0])) and torch.equal(tier.tensor[0], torch.from_numpy(rows[2]))
    out = np.zeros((2, 16), dtype=np.uint8)
    assert tier.read([0, 2], [out[0], out[1]]) == []
    assert np.array_equal(out, rows[[2, 0]])
    tier.tensor[1].fill_(5)
    assert (tier.block(1) == 5).all()          # a view: the store's row copies see the tensor


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device: run on a GPU machine, see docs/gpu.md")])])
def test_device_tier_in_a_store_round_trip_and_demotion(layout, ns, device):
    tiers = [DeviceTier(blocks=4, device=device), kvtier.HostTier(blocks=16)]
    with kvtier.Store(layout, tiers, ns) as store:
        keys = store.keys(list(range(layout.block_tokens * 6)))
        blocks = payload(list(keys), layout.block_bytes)
        store.put(keys[:4], blocks[:4])
        store.put(keys[4:], blocks[4:])          # the top tier is full: two blocks go down to host
        hit = store.lookup(keys)
        assert hit.blocks == 6
        assert hit.by_tier()["device"] + hit.by_tier()["host"] == 6 and hit.by_tier()["device"] == 4
        out = torch.zeros_like(blocks)
        assert store.get(keys, out).loaded == 6
        assert torch.equal(out, blocks)
        st = store.stats().tiers[0]
        assert st.kind == "device" and st.info["device"].startswith(device)
