import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import Keyer, Namespace

LAYOUT = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float16)
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=64)


def keyer(**ns) -> Keyer:
    return Keyer(Namespace(**{"model": "m", **ns}), LAYOUT)


@given(tokens_st)
@settings(max_examples=200)
def test_same_tokens_same_keys(tokens):
    assert keyer()(tokens) == keyer()(list(tokens))


@given(tokens_st, tokens_st)
def test_keys_name_the_whole_prefix(a, b):
    ka, kb = keyer()(a), keyer()(b)
    # Block i has the same key in both iff the first (i+1) blocks of tokens are equal.
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


@given(tokens_st, st.integers(0, 16))
def test_continuing_a_chain_equals_keying_the_whole(tokens, cut_blocks):
    k = keyer()
    full = k(tokens)
    cut = min(cut_blocks, len(full)) * 4
    head = k(tokens[:cut])
    tail = k(tokens[cut:], parent=head)
    assert list(head) + list(tail) == list(full)
    assert tail.start == len(head)


def test_partial_trailing_block_is_not_keyed():
    k = keyer()
    assert len(k(list(range(11)))) == 2
    assert k(list(range(11))) == k(list(range(8)))
    assert len(k([1, 2, 3])) == 0


def test_key_is_16_bytes_and_input_types_agree():
    toks = list(range(100, 164))
    keys = keyer()(toks)
    assert all(isinstance(x, bytes) and len(x) == 16 for x in keys)
    assert keyer()(np.array(toks, dtype=np.int64)) == keys
    assert keyer()(np.array(toks, dtype=np.uint32)) == keys
    assert keyer()(torch.tensor(toks)) == keys


@pytest.mark.parametrize("change", [
    dict(model="other"), dict(revision="r2"), dict(shard="tp1/8"), dict(salt=b"tenant-b"),
])
def test_namespaces_never_share_keys(change):
    toks = list(range(32))
    assert not set(keyer()(toks)) & set(keyer(**change)(toks))


def test_layout_and_hash_change_keys():
    toks = list(range(32))
    base = keyer()(toks)
    other_layout = kvtier.KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4,
                                       dtype=torch.bfloat16)
    assert not set(base) & set(Keyer(Namespace("m"), other_layout)(toks))
    for h in ("sha256", "blake3"):
        ks = Keyer(Namespace("m"), LAYOUT, h)(toks)
        assert len(ks) == len(base) and not set(ks) & set(base)
        assert Keyer(Namespace("m"), LAYOUT, h)(toks) == ks


def test_slices_remember_their_chain():
    keys = keyer()(list(range(40)))
    tail = keys[3:]
    assert tail.start == 3 and tail.parent == keys[2] and tail.prefix() == keys[:3]
    assert keys[3:][2:].start == 5 and keys[3:][2:].prefix() == keys[:5]
    assert keys[:0].prefix() == [] and keys.prefix() == []


def test_bad_tokens_are_refused():
    k = keyer()
    with pytest.raises(LayoutError, match=r"\[0, 2\*\*32\)"):
        k([1, -2, 3, 4])
    with pytest.raises(LayoutError, match="one-dimensional"):
        k(np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(LayoutError, match="integers"):
        k(np.zeros(4, dtype=np.float32))
    with pytest.raises(LayoutError, match="not bytes"):
        k(b"abcd")
    with pytest.raises(ConfigError, match="unknown hash"):
        Keyer(Namespace("m"), LAYOUT, "md5")
    with pytest.raises(ConfigError, match="model"):
        Namespace("")


def test_keys_are_the_same_in_other_processes():
    """Nothing depends on PYTHONHASHSEED: two interpreters with different seeds agree."""
    code = (
        "import torch, kvtier;"
        "l = kvtier.KVLayout.mla(num_layers=61, kv_lora_rank=512, rope_dim=64, block_tokens=16, dtype=torch.bfloat16);"
        "k = kvtier.Keyer(kvtier.Namespace('kimi-k2', 'r1', salt=b's'), l);"
        "print(b''.join(k(list(range(1000)))).hex())"
    )
    outs = []
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.strip())
    assert outs[0] == outs[1] and len(outs[0]) == 62 * 32
