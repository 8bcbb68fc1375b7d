"""Incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    """What the detokenizer needs of a tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, one call per token.

    Byte-level BPE tokens are byte strings; a character of 2–4 UTF-8 bytes can be split across
    tokens (emoji, CJK). The stdlib incremental UTF-8 decoder holds back an incomplete trailing
    sequence until the bytes that complete it arrive, so a piece never contains U+FFFD for a
    character that is merely split. Special tokens (`<|im_end|>`, EOS) add no text unless asked.

    Args:
        tokenizer: gives `token_bytes(id)` and `is_special(id)`.
        skip_special_tokens: control tokens add no text (True, the default) or their own text
            (`<|im_end|>`), as vLLM's `skip_special_tokens`.
    """

    def __init__(self, tokenizer: TokenBytes, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by `token_id` (possibly empty while a character is incomplete)."""
        if self._skip_special and self._tok.is_special(token_id):
            return ""
        return self._decoder.decode(self._tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """End of the stream: an incomplete character still held back (max_tokens cut it) is
        dropped rather than shown as U+FFFD. Returns "" (kept for symmetry with `add`)."""
        self._decoder.reset()
        return ""
