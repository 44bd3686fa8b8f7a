import dataclasses

import pytest
import torch

import kvtier
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import preset_layout


def test_kimi_k2_bytes_per_token():
    layout = kvtier.KVLayout.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, block_tokens=16,
                                 dtype=torch.bfloat16)
    assert layout.bytes_per_token == 70_272
    assert layout.block_bytes == 16 * 70_272
    assert layout.block_shape == (61, 16, 576)
    # a 128k context is 8.6 GiB of KV
    assert abs(131072 * layout.bytes_per_token / 2**30 - 8.58) < 0.01


def test_mha_sizes_and_layer_major_ranges():
    layout = kvtier.KVLayout.mha(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)
    assert layout.layer_shape == (2, 4, 2, 8)
    assert layout.layer_bytes == 2 * 4 * 2 * 8 * 2
    assert layout.block_bytes == 3 * layout.layer_bytes
    ranges = [layout.layer_range(i) for i in range(3)]
    assert ranges == [(0, 256), (256, 256), (512, 256)]
    # Layer i of a block in block_shape is exactly the i-th contiguous range.
    block = torch.arange(layout.block_bytes // 2, dtype=torch.int16).view(torch.float16).view(layout.block_shape)
    raw = block.contiguous().view(-1).view(torch.uint8)
    off, n = layout.layer_range(1)
    assert torch.equal(raw[off:off + n], block[1].contiguous().view(-1).view(torch.uint8))
    with pytest.raises(LayoutError, match="layer 3 out of range"):
        layout.layer_range(3)


def test_fingerprint_changes_with_every_field():
    base = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)
    variants = [
        dataclasses.replace(base, num_layers=3), dataclasses.replace(base, num_kv_heads=4),
        dataclasses.replace(base, head_dim=16), dataclasses.replace(base, block_tokens=8),
        dataclasses.replace(base, dtype=torch.bfloat16), dataclasses.replace(base, variant="rope-deinterleaved"),
        kvtier.KVLayout.mla(num_layers=2, kv_lora_rank=8, rope_dim=8, block_tokens=4, dtype=torch.float16),
    ]
    prints = {base.fingerprint} | {v.fingerprint for v in variants}
    assert len(prints) == len(variants) + 1
    assert base.fingerprint == kvtier.KVLayout.mha(2, 2, 8, 4, torch.float16).fingerprint


def test_round_trip_through_dict():
    layout = preset_layout("kimi-k2", 64)
    assert kvtier.KVLayout.from_dict(layout.to_dict()) == layout


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=0, num_kv_heads=1, head_dim=8, block_tokens=4), "num_layers"),
    (dict(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=-1), "block_tokens"),
    (dict(num_layers=1, num_kv_heads=0, head_dim=8, block_tokens=4), "num_kv_heads"),
])
def test_bad_layouts_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        kvtier.KVLayout.mha(dtype=torch.float16, **kwargs)


def test_unsupported_dtype_and_preset():
    with pytest.raises(LayoutError, match="unsupported KV dtype"):
        kvtier.KVLayout.mha(1, 1, 8, 4, dtype=torch.complex64)
    with pytest.raises(ConfigError, match="kimi-k2"):
        preset_layout("no-such-model", 16)


def test_a_dtype_given_as_a_string_is_named_as_such():
    with pytest.raises(LayoutError, match=r"dtype must be a torch.dtype \(torch.float16\), not the string 'fp16'"):
        kvtier.KVLayout.mha(2, 2, 8, 16, dtype="fp16")
    with pytest.raises(LayoutError, match="unsupported KV dtype torch.float64"):
        kvtier.KVLayout.mha(2, 2, 8, 16, dtype=torch.float64)
