import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.errors import ConfigError, LayoutError
from kvtier.errors import ForeignKeysError
from kvtier.keys import BlockKeys, Keyer, Namespace, chain_keys

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


def test_keys_carry_their_origin_through_slices_joins_and_copies():
    k = keyer()
    keys = k(list(range(40)))
    assert keys.origin is k.origin and keys[3:].origin is k.origin and keys[3:][1:4].origin is k.origin
    more = k(list(range(40, 48)), parent=keys)
    joined = keys + more
    assert isinstance(joined, BlockKeys) and joined.origin is k.origin
    assert list(joined) == list(k(list(range(48)))) and joined.start == 0 and joined.parent == keys.parent
    tail = keys[4:] + more              # a slice continued: keeps its place in the chain
    assert isinstance(tail, BlockKeys) and tail.start == 4 and tail.prefix() == keys[:4]
    assert keys[:2] + keys[2:] == keys and (keys[:2] + keys[2:]).origin is k.origin
    gap = keys[:2] + keys[5:]           # not one chain: a plain list, as list + list is
    assert type(gap) is list and gap == list(keys[:2]) + list(keys[5:])
    assert type(keys[::2]) is list
    for copied in (pickle.loads(pickle.dumps(keys[3:])), copy.copy(keys[3:]), copy.deepcopy(keys[3:]),
                   keys[3:].copy()):
        assert copied == keys[3:] and copied.start == 3 and copied.origin.seed == k.seed


def test_keys_of_two_stores_are_never_joined_or_continued():
    a, b = keyer(), keyer(model="other")
    ka, kb = a(list(range(16))), b(list(range(16, 32)))
    with pytest.raises(ForeignKeysError, match="model 'other'"):
        ka + kb
    with pytest.raises(ForeignKeysError, match="model 'm'"):
        b(list(range(8)), parent=ka)
    with pytest.raises(ForeignKeysError):
        ka += kb
    with pytest.raises(LayoutError, match="parent must be the BlockKeys"):
        a(list(range(8)), parent=list(ka))
    # Keys with no origin (chain_keys from a seed: a trace, a peer's chain) may be continued.
    free = chain_keys(list(range(16)), 4, a.seed)
    assert free.origin is None and a(list(range(16, 24)), parent=free).origin is None
    assert list(free + a(list(range(16, 24)), parent=free)) == list(a(list(range(24))))


@pytest.mark.parametrize("bad, match", [
    ([1.5, 2, 3, 4], r"got 1.5 at position 0: a fractional id"),
    ((1, 2, 3, 4.25), r"got 4.25 at position 3"),
    ([1.0, 2.0, 3.0, 4.0], r"got float64 values \(1.0 at position 0\): convert"),
    ([1, 2, 1.0, 4], r"got float64 values \(1.0 at position 2\): convert"),
    (np.array([1, 2, 3, 4.5]), r"got 4.5 at position 3"),
    (np.array([1, 2, 3, np.nan]), r"got nan at position 3"),
    (np.ones(4, dtype=np.float32), r"got float32 values"),
    (torch.tensor([1, 2, 3, 4.0]), r"got a torch.float32 tensor"),
    (torch.ones(4, dtype=torch.bfloat16), r"got a torch.bfloat16 tensor"),
    (torch.ones(4, dtype=torch.bool), r"got a torch.bool tensor"),
    (np.ones(4, dtype=bool), r"booleans"),
    ([1, 2, "3", 4], r"got '3' \(str\) at position 2: tokenize text first"),
    ("abcd", r"not bytes or a string"),
    ([1, None, 3, 4], r"got None \(NoneType\) at position 1"),
    ([1, 2, 3, 2**70], r"\[0, 2\*\*32\), got 1180591620717411303424 at position 3"),
    ([1, 2, 2**32, 4], r"\[0, 2\*\*32\), got 4294967296 at position 2"),
    (np.array([0, -1, 2, 3], dtype=np.int8), r"\[0, 2\*\*32\), got -1 at position 1"),
    (torch.tensor([1, 2, 3, 2**33]), r"\[0, 2\*\*32\), got 8589934592 at position 3"),
    ([[1, 2], [3]], r"flat sequence"),
    ([[1, 2], [3, 4]], r"one-dimensional"),
    (torch.empty(32, dtype=torch.long, device="meta"), r"meta device have no values"),
])
def test_token_ids_that_are_not_ids_are_refused(bad, match):
    with pytest.raises(LayoutError, match=match):
        keyer()(bad)


def test_integer_ids_of_every_kind_give_the_same_keys():
    toks = [0, 7, 65535, 2**32 - 1] * 4
    want = keyer()(toks)
    for same in (tuple(toks), np.array(toks, dtype=np.uint32), np.array(toks, dtype=np.int64),
                 np.array(toks, dtype=np.uint64), torch.tensor(toks, dtype=torch.int64),
                 [np.int64(t) for t in toks]):
        assert keyer()(same) == want
    small = [1, 2, 3, 4, 200, 100, 0, 255]
    assert keyer()(np.array(small, dtype=np.uint8)) == keyer()(small) == keyer()(range(1, 5)) + keyer()(small)[1:]
    for empty in ([], (), np.array([]), torch.tensor([]), np.array([], dtype=np.int32)):
        assert keyer()(empty) == []


@pytest.mark.parametrize("shard", ["garbage", "tp8/8", "tp00/8", "pp0/2,tp0/2"])
def test_namespace_refuses_a_shard_that_would_silently_be_another_namespace(shard):
    with pytest.raises(kvtier.ConfigError, match="shard"):
        Namespace("m", shard=shard)
    assert Namespace("m", shard="tp0/8,pp1/4").shard == "tp0/8,pp1/4"
