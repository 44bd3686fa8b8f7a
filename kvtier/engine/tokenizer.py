"""Text <-> token ids for the reference engine.

Three backends behind one small protocol, picked by `load_tokenizer` from what a
checkpoint directory holds:

* `ByteTokenizer`: UTF-8 bytes are ids 0..255, BOS 256, EOS 257. Needs no files, so
  the tiny random-weight presets can take and return text anywhere.
* `HFTokenizer`: a Hugging Face `tokenizer.json` (DeepSeek-V3), via `tokenizers`.
* `TiktokenTokenizer`: Kimi K2's `tiktoken.model` (BPE ranks, "base64token rank" a
  line) plus the special tokens in `tokenizer_config.json`'s `added_tokens_decoder`,
  built the way Moonshot's `tokenization_kimi.py` builds it, via `tiktoken`.

Conventions shared by all three: `encode` never adds BOS/EOS (prepend `bos_token_id`
yourself where the model wants it) and reads special-token text such as "<|im_end|>"
in the input as that special token, as the checkpoints' own tokenizers do; `decode`
skips special tokens and ids the tokenizer does not know unless told otherwise, and
never raises on a partial UTF-8 sequence (it yields U+FFFD), so it is safe to call on
the tokens generated so far.
"""
from __future__ import annotations

import base64
import binascii
import importlib
import json
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from kvtier.errors import ConfigError

__all__ = [
    "Tokenizer", "ByteTokenizer", "HFTokenizer", "TiktokenTokenizer", "load_tokenizer",
    "KIMI_PAT_STR",
]

# Kimi K2's pre-tokenizer (tokenization_kimi.py): Han runs first, then cased letter runs
# with Han subtracted (so "中文English" splits in two), 1-3 digits, punctuation, spaces.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Kimi reserves this many ids after the BPE ranks for special tokens; the ones that
# added_tokens_decoder does not name are "<|reserved_token_{id}|>".
KIMI_NUM_RESERVED_SPECIAL = 256

_TOKENIZER_FILES = "tokenizer.json (Hugging Face tokenizers) or tiktoken.model (+ tokenizer_config.json, Kimi)"


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    name: str                    # what it is, for logs: "byte-level (random-weight preset)", a path
    vocab_size: int              # ids are in [0, vocab_size)
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS = 256, EOS = 257; ids 258.. decode to nothing."""

    BOS = 256
    EOS = 257
    NUM_IDS = 258

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < self.NUM_IDS:
            raise ConfigError(f"the byte-level tokenizer needs vocab_size >= {self.NUM_IDS} (256 bytes, BOS, EOS), "
                              f"got {vocab_size}: raise the model's vocab_size, or pass a tokenizer directory")
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id: int | None = self.EOS
        self.name = "byte-level (random-weight preset)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
            elif not skip_special and i in (self.BOS, self.EOS):
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append("<bos>" if i == self.BOS else "<eos>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class NoTokenizer:
    """A checkpoint folder without tokenizer files (save_checkpoint writes none): token ids
    work; text prompts are refused, saying why, and outputs have no text."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = None
        self.eos_token_id: int | None = None
        self.name = f"none ({path} holds no tokenizer files)"
        self._path = path

    def encode(self, text: str) -> list[int]:
        raise ConfigError(f"{self._path} holds no tokenizer ({_TOKENIZER_FILES}), so a text prompt cannot be "
                          "encoded: pass token ids, or copy the checkpoint's tokenizer files into it")

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return ""


def _optional(module: str, file: str) -> Any:
    """An optional dependency of the `engine` extra, or a ConfigError saying how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"reading {file} needs the `{module}` package: "
                          "pip install 'kvtier[engine]' (or pass token ids)") from e


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, with BOS/EOS from tokenizer_config.json or config.json."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        _HFTok = _optional("tokenizers", "tokenizer.json").Tokenizer
        file = path / "tokenizer.json"
        try:
            self._tok = _HFTok.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(f"{file}: not a tokenizers file ({e}); re-download the checkpoint's tokenizer") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.name = f"tokenizers: {file}"
        cfg, model_cfg = _read_json(path / "tokenizer_config.json"), _read_json(path / "config.json")
        self.bos_token_id = _special_id(cfg, model_cfg, "bos", self._tok.token_to_id, path)
        self.eos_token_id = _special_id(cfg, model_cfg, "eos", self._tok.token_to_id, path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and self._tok.id_to_token(int(i)) is not None]
        return self._tok.decode(known, skip_special_tokens=skip_special)


class TiktokenTokenizer:
    """Kimi K2's tokenizer: `tiktoken.model` BPE ranks, Kimi's regex, added_tokens_decoder specials."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tiktoken = _optional("tiktoken", "tiktoken.model")
        file = path / "tiktoken.model"
        ranks = _load_bpe_ranks(file)
        num_base = len(ranks)
        if sorted(ranks.values()) != list(range(num_base)):
            raise ConfigError(f"{file}: the ranks are not 0..{num_base - 1} each once; "
                              f"re-download the checkpoint's tiktoken.model")
        cfg, model_cfg = _read_json(path / "tokenizer_config.json"), _read_json(path / "config.json")
        named = _added_tokens(cfg, path)
        clash = sorted(i for i in named if i < num_base)
        if clash:
            raise ConfigError(f"{path / 'tokenizer_config.json'}: added token ids {clash[:5]} fall inside the "
                              f"{num_base} BPE ranks of {file}; the two files are from different tokenizers")
        end = max([num_base + KIMI_NUM_RESERVED_SPECIAL, *(i + 1 for i in named)])
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, end)}
        try:
            self._enc = tiktoken.Encoding(name=file.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        except Exception as e:  # tiktoken asserts / raises ValueError on inconsistent ranks
            raise ConfigError(f"{file}: tiktoken rejected the ranks ({e}); re-download the checkpoint's tokenizer") from e
        self._special_ids = set(self.special_tokens.values())
        self.vocab_size = end
        self.name = f"tiktoken: {file}"
        lookup = self.special_tokens.get
        # Kimi's TikTokenTokenizer defaults bos/eos to "[BOS]"/"[EOS]" when the config names none.
        self.bos_token_id = _special_id(cfg, model_cfg, "bos", lookup, path, default=lookup("[BOS]"))
        self.eos_token_id = _special_id(cfg, model_cfg, "eos", lookup, path, default=lookup("[EOS]"))

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        keep = [int(i) for i in ids if 0 <= int(i) < self.vocab_size
                and not (skip_special and int(i) in self._special_ids)]
        return self._enc.decode(keep, errors="replace")


def load_tokenizer(path: str | Path | None, vocab_size: int) -> Tokenizer:
    """The tokenizer of a checkpoint directory (or the byte-level one for None), checked against the model.

    A path to tokenizer.json or tiktoken.model itself is taken to mean its directory.
    """
    if path is None:
        return ByteTokenizer(vocab_size)
    p = Path(path)
    if p.is_file() and p.name in ("tokenizer.json", "tiktoken.model"):
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"tokenizer path {str(path)!r} is not a directory; pass the checkpoint directory "
                          f"holding {_TOKENIZER_FILES}, or pass token ids instead of text")
    tok: Tokenizer
    if (p / "tokenizer.json").is_file():
        tok = HFTokenizer(p)
    elif (p / "tiktoken.model").is_file():
        tok = TiktokenTokenizer(p)
    else:
        return NoTokenizer(p, vocab_size)        # token ids still work (and nothing has text)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"{tok.name} has {tok.vocab_size} ids but the model's vocab_size is {vocab_size}: "
                          f"the tokenizer belongs to another model; use the checkpoint's own tokenizer files")
    return tok


# ---------------------------------------------------------------- helpers


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not readable JSON ({e}); fix or re-download it") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object at the top level; fix or re-download it")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ..., ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_id(cfg: dict[str, Any], model_cfg: dict[str, Any], which: str, lookup: Any, path: Path,
                default: int | None = None) -> int | None:
    """The id of bos/eos: tokenizer_config.json's {which}_token, else config.json's {which}_token_id."""
    text = _token_text(cfg.get(f"{which}_token"))
    if text is not None:
        tid = lookup(text)
        if tid is None:
            raise ConfigError(f"{path / 'tokenizer_config.json'}: {which}_token {text!r} is not a token of the "
                              f"tokenizer; fix the config or re-download the checkpoint's tokenizer files")
        return int(tid)
    tid = model_cfg.get(f"{which}_token_id")
    if isinstance(tid, list):  # some configs list several EOS ids; the first is the canonical one
        tid = tid[0] if tid else None
    if isinstance(tid, int) and not isinstance(tid, bool):
        return tid
    return default


def _added_tokens(cfg: dict[str, Any], path: Path) -> dict[int, str]:
    """added_tokens_decoder: {"163584": {"content": "[BOS]", ...}, ...} -> {163584: "[BOS]"}."""
    out: dict[int, str] = {}
    for key, value in (cfg.get("added_tokens_decoder") or {}).items():
        text = _token_text(value)
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if text is None or tid < 0:
            raise ConfigError(f"{path / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r}: {value!r} "
                              f"is not an id -> {{'content': token}}; fix or re-download it")
        out[tid] = text
    return out


def _load_bpe_ranks(file: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file ("base64token rank" a line), as tiktoken.load does, without its cache."""
    try:
        lines = file.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(f"{file}: cannot read it ({e})") from e
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ConfigError(f"{file}:{n}: expected 'base64token rank', got {line[:60]!r}; "
                              f"re-download the checkpoint's tiktoken.model") from e
    if not ranks:
        raise ConfigError(f"{file}: no BPE ranks in it; re-download the checkpoint's tiktoken.model")
    return ranks
