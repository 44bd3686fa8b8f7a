"""The C key chain (kvtier._chain) gives exactly the Python path's keys.

The extension is optional (built by `pip install -e .` where a C compiler exists);
without it the equivalence tests skip, unless KVTIER_REQUIRE_NATIVE=1 says it must be
there (set it where the build is expected to succeed).
"""
import os
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import keys as kmod
from kvtier.errors import ConfigError
from kvtier.keys import BlockKeys, chain_keys

try:
    from kvtier import _chain
except ImportError:
    _chain = None

needs_native = pytest.mark.skipif(
    _chain is None,
    reason="kvtier._chain is not built (no C compiler at install time?): "
           "`pip install -e .` builds it; the Python key path is used instead")


def python_chain(data: bytes, block_tokens: int, parent: bytes) -> list[bytes]:
    """The reference: the definition, one xxh3_128_digest per block."""
    step = 4 * block_tokens
    out, p = [], parent
    for i in range(0, len(data) - len(data) % step, step):
        p = xxhash.xxh3_128_digest(p + data[i:i + step])
        out.append(p)
    return out


def test_native_is_built_where_required():
    if os.environ.get("KVTIER_REQUIRE_NATIVE", "") not in ("", "0"):
        assert _chain is not None, "KVTIER_REQUIRE_NATIVE is set but kvtier._chain did not build/import"
        if os.environ.get("KVTIER_NO_NATIVE", "") in ("", "0"):
            assert kmod.NATIVE


def test_native_flag_matches_what_imported():
    forced_off = os.environ.get("KVTIER_NO_NATIVE", "") not in ("", "0")
    assert kmod.NATIVE is (_chain is not None and not forced_off)


@needs_native
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
       block_tokens=st.integers(1, 40), parent=st.binary(min_size=16, max_size=16))
@settings(max_examples=300, deadline=None)
def test_native_equals_python(tokens, block_tokens, parent):
    data = np.array(tokens, dtype="<u4").tobytes()
    native = _chain.chain_xxh3(data, block_tokens, parent)
    assert native == python_chain(data, block_tokens, parent)
    assert all(type(k) is bytes and len(k) == 16 for k in native)
    assert len(native) == len(tokens) // block_tokens


@needs_native
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
       block_tokens=st.integers(1, 24), parent=st.binary(min_size=16, max_size=16),
       start=st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_chain_keys_native_equals_python_path(tokens, block_tokens, parent, start):
    arr = np.array(tokens, dtype=np.int64)
    native = chain_keys(arr, block_tokens, parent, "xxh3", start=start)
    saved, kmod._chain_xxh3 = kmod._chain_xxh3, None   # force the Python path
    try:
        py = chain_keys(arr, block_tokens, parent, "xxh3", start=start)
    finally:
        kmod._chain_xxh3 = saved
    assert isinstance(native, BlockKeys)
    assert list(native) == list(py) == python_chain(arr.astype("<u4").tobytes(), block_tokens, parent)
    assert (native.parent, native.start) == (py.parent, py.start) == (parent, start)


@needs_native
def test_native_long_chain_and_bytes_like_inputs():
    # Long enough that the C loop runs with the GIL released; bytes-like inputs work.
    rng = np.random.default_rng(1)
    data = rng.integers(0, 2**32, 4096 * 16 + 7, dtype=np.uint64).astype("<u4").tobytes()
    parent = bytes(range(16))
    ref = python_chain(data, 16, parent)
    assert len(ref) == 4096
    assert _chain.chain_xxh3(data, 16, parent) == ref
    assert _chain.chain_xxh3(bytearray(data), 16, bytearray(parent)) == ref
    assert _chain.chain_xxh3(memoryview(data), block_tokens=16, parent=memoryview(parent)) == ref
    # A block longer than the data, or empty data: no full block, no key.
    assert _chain.chain_xxh3(data, len(data), parent) == []
    assert _chain.chain_xxh3(b"", 1, parent) == []


@needs_native
def test_native_from_threads():
    data = np.arange(8192 * 16, dtype="<u4").tobytes()
    ref = _chain.chain_xxh3(data, 16, b"\0" * 16)
    results = []

    def work():
        results.append(_chain.chain_xxh3(data, 16, b"\0" * 16))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [ref] * 4


@needs_native
@pytest.mark.parametrize("args, match", [
    ((b"\0" * 6, 1, b"\0" * 16), "multiple of 4"),
    ((b"\0" * 8, 0, b"\0" * 16), "block_tokens must be positive"),
    ((b"\0" * 8, -3, b"\0" * 16), "block_tokens must be positive"),
    ((b"\0" * 8, 1, b"\0" * 15), "exactly 16 bytes"),
    ((b"\0" * 8, 1, b"\0" * 17), "exactly 16 bytes"),
    ((b"\0" * 8, 1, b""), "exactly 16 bytes"),
])
def test_native_bad_inputs_raise_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        _chain.chain_xxh3(*args)


@needs_native
def test_native_bad_types_raise_type_error():
    with pytest.raises(TypeError):
        _chain.chain_xxh3("text", 1, b"\0" * 16)
    with pytest.raises(TypeError):
        _chain.chain_xxh3(b"\0" * 8, 1.0, b"\0" * 16)
    with pytest.raises(TypeError):
        _chain.chain_xxh3(b"\0" * 8, 1)


def test_chain_keys_bad_inputs_raise_config_error_on_either_path():
    with pytest.raises(ConfigError):
        chain_keys([1, 2, 3, 4], 0, b"\0" * 16)
    with pytest.raises(ConfigError):
        chain_keys([1, 2, 3, 4], 2, b"\0" * 15)


def test_no_native_env_gives_the_same_keys_in_a_subprocess():
    """KVTIER_NO_NATIVE=1 forces the Python path; its keys equal this process's."""
    tokens = list(range(1000, 1000 + 16 * 37 + 5))
    parent = bytes(range(100, 116))
    here = chain_keys(tokens, 16, parent)
    code = (
        "import sys; from kvtier import keys as k\n"
        f"ks = k.chain_keys({tokens!r}, 16, {parent!r})\n"
        "print(k.NATIVE); print(b''.join(ks).hex())\n"
    )
    env = {**os.environ, "KVTIER_NO_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out[0] == "False"
    assert bytes.fromhex(out[1]) == b"".join(here)
    assert len(here) == 37


@pytest.mark.parametrize("n", [0, 1, 4095, 1 << 16, (1 << 20) + 3])
def test_native_block_checksum_is_xxh3_64(n):
    """The disk tier's and the nodes' block checksum (C, GIL released) equals python-xxhash's."""
    xxh3_64 = pytest.importorskip("kvtier._chain").xxh3_64
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert xxh3_64(data) == xxhash.xxh3_64_intdigest(data) == xxh3_64(data.tobytes())


def test_block_checksums_hash_each_block_like_block_checksum():
    """The many-blocks call (one GIL release for a put's blocks) gives each block's own
    xxh3-64, in order, for numpy rows, bytes and memoryviews of any size; the Python fallback
    gives the same."""
    from kvtier import checksum

    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 4095, 1 << 16, (1 << 20) + 3)]
    blocks = rows + [rows[3].tobytes(), memoryview(rows[2])]
    want = [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert checksum.block_checksums(blocks) == want
    assert checksum.block_checksums(tuple(blocks)) == want
    assert checksum.block_checksums([]) == []
    assert [checksum.block_checksum(b) for b in blocks] == want


def test_native_block_checksums_bad_input_raises_and_leaks_no_buffer():
    """A non-buffer item is a TypeError, and the buffers taken before it are released (a
    buffer kept would hold a reference to its array)."""
    import sys

    many = pytest.importorskip("kvtier._chain").xxh3_64_many
    a = np.zeros(1 << 17, dtype=np.uint8)
    refs = sys.getrefcount(a)
    with pytest.raises(TypeError):
        many([a, a, 3])
    with pytest.raises(TypeError):
        many(5)
    many([a, a])
    assert sys.getrefcount(a) == refs


def test_x86_builds_take_xxhash_runtime_dispatch():
    """On x86 the checksum is built with xxHash's CPU dispatch (AVX2 where present), not the
    portable SSE2 baseline, which hashes at half the speed."""
    chain = pytest.importorskip("kvtier._chain")
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
    assert chain.XXH_DISPATCH == int(x86)
