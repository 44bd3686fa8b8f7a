"""kvtier.engine.tokenizer: byte-level, Hugging Face tokenizer.json, Kimi's tiktoken.model, and load_tokenizer."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
from kvtier.errors import ConfigError

torch.set_num_threads(1)


# ---------------------------------------------------------------- byte-level


@pytest.mark.parametrize("text", ["", "hello, world", "héllo wörld", "日本語のテキスト", "emoji 🦀🚀 and 👩‍👩‍👧", "tab\tnl\n\x00"])
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer(300)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text: str) -> None:
    tok = ByteTokenizer(258)
    assert tok.decode(tok.encode(text)) == text


def test_byte_partial_utf8_decodes_without_raising() -> None:
    tok = ByteTokenizer(258)
    crab = tok.encode("🦀")
    assert len(crab) == 4
    for cut in range(1, 4):      # generation stopped mid-character
        out = tok.decode(tok.encode("ok ") + crab[:cut])
        assert out.startswith("ok ") and "\ufffd" in out and "🦀" not in out
    assert tok.decode(crab) == "🦀"


def test_byte_specials_and_unknown_ids_are_skipped() -> None:
    tok = ByteTokenizer(512)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (256, 257, 512)
    ids = [tok.bos_token_id, *tok.encode("hi"), 300, 511, tok.eos_token_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos>"
    assert isinstance(tok, Tokenizer) and "byte" in tok.name


def test_byte_vocab_too_small() -> None:
    with pytest.raises(ConfigError, match="258"):
        ByteTokenizer(257)


# ---------------------------------------------------------------- Hugging Face tokenizer.json


def _write_hf(path: Path, *, config: dict | None = None, model_config: dict | None = None) -> Path:
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "kv": 5, "cache": 6, "!": 7}
    tok = HFTok(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()          # joins words with spaces, glues punctuation
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if model_config is not None:
        (path / "config.json").write_text(json.dumps(model_config))
    return path


def test_hf_round_trip_and_specials(tmp_path: Path) -> None:
    d = _write_hf(tmp_path / "ckpt", config={"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}})
    tok = load_tokenizer(d, vocab_size=16)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 8)
    ids = tok.encode("hello world kv cache")
    assert ids == [3, 4, 5, 6]                    # no BOS added
    assert tok.decode(ids) == "hello world kv cache"
    assert tok.decode([1, *ids, 2]) == "hello world kv cache"
    assert "</s>" in tok.decode([*ids, 2], skip_special=False)
    assert tok.encode("hello </s>") == [3, 2]     # special-token text reads as the special token
    assert tok.decode([3, 99, -1, 4]) == "hello world"   # ids outside the tokenizer are dropped


def test_hf_bos_eos_from_config_json(tmp_path: Path) -> None:
    d = _write_hf(tmp_path / "ckpt", model_config={"bos_token_id": 1, "eos_token_id": [2, 7]})
    tok = HFTokenizer(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    d2 = _write_hf(tmp_path / "bare")
    assert (HFTokenizer(d2).bos_token_id, HFTokenizer(d2).eos_token_id) == (None, None)


def test_hf_unknown_bos_token_is_an_error(tmp_path: Path) -> None:
    d = _write_hf(tmp_path / "ckpt", config={"bos_token": "<|begin|>"})
    with pytest.raises(ConfigError, match="bos_token"):
        HFTokenizer(d)


def test_hf_malformed_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(tmp_path, vocab_size=100)


# ---------------------------------------------------------------- Kimi tiktoken.model

HAN_WEN = "文".encode()           # 3 bytes
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b" wo", b"rl", b" wor", b" world",
          HAN_WEN[:2], HAN_WEN, HAN_WEN + b"E"]   # the last one straddles a Han/Latin boundary


def _write_tiktoken(path: Path, config: dict | None = None, merges: list[bytes] = MERGES) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    ranks = [bytes([b]) for b in range(256)] + merges
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    n = len(ranks)
    if config is None:
        config = {"bos_token": "[BOS]", "eos_token": "[EOS]",
                  "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                           str(n + 1): {"content": "[EOS]", "special": True}}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_tiktoken_round_trip_and_specials(tmp_path: Path) -> None:
    d = _write_tiktoken(tmp_path / "kimi")
    n = 256 + len(MERGES)
    tok = load_tokenizer(d, vocab_size=n + 256)
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (n, n + 1)
    assert tok.vocab_size == n + 256             # Kimi reserves 256 special ids after the ranks
    hello, world = 256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")
    assert tok.encode("hello world") == [hello, world]
    for text in ["hello world", "héllo, wörld! 123456", "日本語 and 🦀", "a\n\n  b\t", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello[EOS]") == [hello, n + 1]
    assert tok.decode([n, hello, n + 1, n + 100]) == "hello"     # [BOS], [EOS], a reserved id: skipped
    assert tok.decode([hello, n + 1], skip_special=False) == "hello[EOS]"
    assert tok.decode([hello, 10**9, -5]) == "hello"
    assert tok.decode(tok.encode("🦀")[:2]).endswith("\ufffd")  # partial UTF-8 does not raise


def test_tiktoken_uses_kimis_han_split(tmp_path: Path) -> None:
    """Kimi's regex puts a Han run in its own pre-token, so no merge may straddle 文|E."""
    tok = TiktokenTokenizer(_write_tiktoken(tmp_path / "kimi"))
    wen = 256 + MERGES.index(HAN_WEN)
    assert tok.encode("文English") == [wen, *b"English"]
    assert tok.decode(tok.encode("中文English混合")) == "中文English混合"


def test_tiktoken_defaults_and_config_json(tmp_path: Path) -> None:
    n = 256 + len(MERGES)
    cfg = {"added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"},
                                    str(n + 300): {"content": "<|far|>"}}}
    tok = TiktokenTokenizer(_write_tiktoken(tmp_path / "a", cfg))
    assert (tok.bos_token_id, tok.eos_token_id) == (n, n + 1)     # Kimi's "[BOS]"/"[EOS]" defaults
    assert tok.vocab_size == n + 301                               # covers the highest added id
    d = _write_tiktoken(tmp_path / "b", {"added_tokens_decoder": {}})
    (d / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 6}))
    assert (TiktokenTokenizer(d).bos_token_id, TiktokenTokenizer(d).eos_token_id) == (5, 6)


def test_tiktoken_bad_files(tmp_path: Path) -> None:
    d = _write_tiktoken(tmp_path / "bad")
    (d / "tiktoken.model").write_text("aGk= 0\nnot-a-line\n")
    with pytest.raises(ConfigError, match="tiktoken.model:2"):
        TiktokenTokenizer(d)
    d = _write_tiktoken(tmp_path / "clash", {"added_tokens_decoder": {"5": {"content": "[BOS]"}}})
    with pytest.raises(ConfigError, match="different tokenizers"):
        TiktokenTokenizer(d)


# ---------------------------------------------------------------- load_tokenizer


def test_load_none_is_byte_level() -> None:
    tok = load_tokenizer(None, vocab_size=1024)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 1024
    with pytest.raises(ConfigError):
        load_tokenizer(None, vocab_size=100)


def test_load_errors(tmp_path: Path) -> None:
    none = load_tokenizer(tmp_path, vocab_size=1000)               # a dir with neither file: token ids only
    assert none.decode([1, 2]) == "" and none.eos_token_id is None
    with pytest.raises(ConfigError, match="tokenizer.json.*tiktoken.model.*pass token ids"):
        none.encode("text")
    with pytest.raises(ConfigError, match="not a directory"):
        load_tokenizer(tmp_path / "missing", vocab_size=1000)
    d = _write_tiktoken(tmp_path / "kimi")
    with pytest.raises(ConfigError, match="vocab_size"):
        load_tokenizer(d, vocab_size=300)                           # tokenizer has 524 ids


def test_load_accepts_the_file_itself(tmp_path: Path) -> None:
    d = _write_hf(tmp_path / "ckpt")
    assert isinstance(load_tokenizer(d / "tokenizer.json", vocab_size=8), HFTokenizer)
