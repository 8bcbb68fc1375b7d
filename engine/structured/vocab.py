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
    `bos_token_id`, `special_token_ids` and a call that tokenizes bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


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
