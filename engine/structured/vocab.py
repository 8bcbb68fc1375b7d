"""The served model's vocabulary as llguidance sees it (`llguidance.LLTokenizer`).

llguidance computes a token mask by walking a trie of every token's bytes; it needs each token's
exact bytes, which ids are control tokens (never allowed by a grammar, except the end-of-sequence
token where the grammar may end), and the end-of-sequence id. genserve's tokenizers
(`engine.tokenizer.Tokenizer`) already hold all three, so the vocabulary is handed over as bytes
rather than through a Hugging Face tokenizer object. Building it takes ≈ 0.2 s for SmolLM2's
49,152 tokens on 2 CPU cores; do it once per process.
"""

from __future__ import annotations

from typing import Any


class _Vocabulary:
    """The duck type `llguidance.TokenizerWrapper` reads: `tokens` (bytes per id), `eos_token_id`,
    `bos_token_id`, `special_token_ids` and a call that tokenizes bytes.

    The call must give tokens whose bytes are exactly the text's: llguidance tokenizes the bytes
    a grammar forces (``<tool_call>\n`` ...) with it and allows those tokens. The tokenizer's
    `encode` is not that for a Llama-2-style or Llama 3 file, whose post-processor puts a BOS
    first (the forced text then allowed only the BOS, and a constrained sample ended at once),
    nor is plain-text encoding for a SentencePiece file, whose normalizer prepends "▁" (a space):
    the text is tokenized as plain text (`encode_text`) and, when the bytes still differ, by the
    longest matching token at each position (`_greedy`).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer
        self._by_bytes: dict[bytes, int] | None = None      # built on first `_greedy`
        self._longest = 1

    def __call__(self, text: bytes | str) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        encode = getattr(self._tokenizer, "encode_text", self._tokenizer.encode)
        ids = encode(data.decode("utf-8", errors="replace"))
        if b"".join(self.tokens[i] for i in ids) == data:
            return ids
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        """Tokens whose bytes are `data`: the longest token (not a control token) matching at each
        position; a byte no token spells is skipped (a vocabulary without byte tokens)."""
        if self._by_bytes is None:
            special = set(self.special_token_ids)
            self._by_bytes = {}
            for i, b in enumerate(self.tokens):
                if b and i not in special:
                    self._by_bytes.setdefault(b, i)
            self._longest = max(map(len, self._by_bytes), default=1)
        ids, pos = [], 0
        while pos < len(data):
            for size in range(min(self._longest, len(data) - pos), 0, -1):
                token = self._by_bytes.get(data[pos:pos + size])
                if token is not None:
                    ids.append(token)
                    pos += size
                    break
            else:
                pos += 1
        return ids


def llg_tokenizer(tokenizer: Any):
    """An `llguidance.LLTokenizer` over `tokenizer`'s vocabulary.

    Args:
        tokenizer: has `vocab_size`, `eos_token_id`, `token_bytes(id)`, `is_special(id)` and
            `encode(text)` (`engine.tokenizer.Tokenizer`).
    Raises:
        ValueError: the tokenizer has no end-of-sequence token (a grammar could never end the
            output; genserve's byte-level tokenizer of random models has none).
    """
    import llguidance

    if tokenizer.eos_token_id is None:
        raise ValueError("the served model's tokenizer has no end-of-sequence token")
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer)))
