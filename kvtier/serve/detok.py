"""Tokens -> text as they arrive, so that the streamed pieces join to the whole text.

A token may end in the middle of a UTF-8 character (byte-level tokenizers, byte-fallback
BPE): decoding it then yields U+FFFD. Such a tail is held back until the token that
completes it arrives (or the request ends). Each step decodes only a short window (the
previous piece's tokens and the new ones) and emits what the new tokens added, so the
cost per token does not grow with the length of the answer. The non-streamed answer is
the same pieces joined, so the two are equal by construction.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Feed token ids with push(); each call returns the text they completed."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0      # window start: tokens already emitted that give the new ones context
        self._read = 0        # tokens whose text has been emitted
        self.pieces: list[str] = []

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids)
        if self._read == len(self.ids) and not final:
            return ""
        before = self._tok.decode(self.ids[self._prefix:self._read])
        now = self._tok.decode(self.ids[self._prefix:])
        if not final and (now.endswith(REPLACEMENT) or len(now) <= len(before) or not now.startswith(before)):
            return ""                                   # an incomplete character (or nothing new) yet
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        if piece:
            self.pieces.append(piece)
        return piece

    @property
    def text(self) -> str:
        return "".join(self.pieces)
