"""engine.tokenizer: the GGUF byte-level BPE against transformers' GGUF tokenizer, and exact bytes."""

from __future__ import annotations

import random

import pytest

from engine.tokenizer import Tokenizer, bytes_to_unicode

STRINGS = [
    "The capital of France is",
    "Hello, world!",
    "  leading spaces",
    "trailing spaces   ",
    "\n\n",
    "line one\nline two\r\n\tindented",
    "Digits 0123456789 and 3.14159, 1,000,000 and 2024-06-01",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }  // C++",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "emoji 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "中文测试：你好，世界！",
    "日本語のテキストと한국어",
    "Ünïcödé café naïve façade Æsir",
    "Привет, мир",
    "I'm sure they'll say we'd've done it",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "https://example.com/path?q=a&b=%20c#frag",
    "      ",
    "a",
    "x² + y³ = z",
]


@pytest.fixture(scope="module")
def hf_tokenizer(hf_reference_model):
    return hf_reference_model[1]


def test_metadata(gguf_tokenizer):
    tok = gguf_tokenizer
    assert tok.vocab_size == len(tok) == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.add_bos_token is False
    assert tok.id_to_token(tok.eos_token_id) == "<|im_end|>"
    assert [i for i in range(tok.vocab_size) if tok.is_special(i)] == list(range(17))
    assert not tok.is_special(504)
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", STRINGS)
def test_ids_equal_transformers(gguf_tokenizer, hf_tokenizer, text):
    assert gguf_tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_known_ids(gguf_tokenizer):
    # no BOS; "<|im_end|>" in text is the single control token
    assert gguf_tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert gguf_tokenizer.encode("<|im_end|>") == [2]
    assert gguf_tokenizer.encode("") == []
    assert gguf_tokenizer.encode_batch(["Hello", "a"]) == [gguf_tokenizer.encode("Hello"),
                                                           gguf_tokenizer.encode("a")]


@pytest.mark.parametrize("text", STRINGS)
def test_round_trips(gguf_tokenizer, text):
    ids = gguf_tokenizer.encode(text)
    assert gguf_tokenizer.decode(ids) == text
    assert b"".join(gguf_tokenizer.token_bytes(t) for t in ids).decode("utf-8") == text


def test_round_trips_random_unicode(gguf_tokenizer):
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 0x3000) if not 0xD800 <= c < 0xE000] + \
        ["😀", "🇫🇷", "\n", "\t", " ", " ", "7"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = gguf_tokenizer.encode(text)
        assert b"".join(gguf_tokenizer.token_bytes(t) for t in ids).decode("utf-8") == text
        assert gguf_tokenizer.decode(ids) == text


def test_token_bytes_whole_vocab(gguf_tokenizer, hf_tokenizer):
    """Every id: the GPT-2 byte map reversed over transformers' token string; control tokens
    give their text. Decoding any id sequence matches transformers (U+FFFD for broken UTF-8)."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tok = gguf_tokenizer
    tokens = hf_tokenizer.convert_ids_to_tokens(list(range(tok.vocab_size)))
    for i, t in enumerate(tokens):
        expected = t.encode() if tok.is_special(i) else bytes(byte_of[c] for c in t)
        assert tok.token_bytes(i) == expected, i
    assert tok.token_bytes(216) == b" " and tok.token_bytes(2) == b"<|im_end|>"
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        assert tok.decode(ids) == hf_tokenizer.decode(ids)


def test_multibyte_character_split_across_tokens(gguf_tokenizer):
    """A CJK character / emoji may span tokens: each token is a byte fragment, the join is exact."""
    ids = gguf_tokenizer.encode("😀")
    parts = [gguf_tokenizer.token_bytes(t) for t in ids]
    assert len(parts) > 1 and b"".join(parts) == "😀".encode()


def test_smollm_digit_split_for_unicode_numerals(gguf_tokenizer):
    """``pre = "smollm"`` splits every \\p{N} character off before the GPT-2 regex (llama.cpp
    LLAMA_VOCAB_PRE_TYPE_SMOLLM; SmolLM2's tokenizer.json: Digits(individual_digits=True)), so the
    space before a numeral is a token of its own. transformers' GGUF tokenizer (plain GPT-2 regex)
    differs here for non-ASCII numerals such as " ½" or Arabic-Indic digits; for ASCII digits the
    vocabulary has no "space+digit" merges and both agree."""
    space = gguf_tokenizer.encode(" ")
    assert space == [216]
    for numeral in ("½", "١", "Ⅻ", "7"):
        assert gguf_tokenizer.encode(" " + numeral) == space + gguf_tokenizer.encode(numeral), numeral


def test_plain_gpt2_pre_tokenizer_when_file_says_gpt2():
    """The digit split is tied to ``pre``; a tiny vocabulary shows the difference."""
    alphabet = sorted(set(bytes_to_unicode().values()))
    tokens = alphabet + ["Ġ1"]
    merges = ["Ġ 1"]
    gpt2 = Tokenizer(tokens, merges, pre="gpt2")
    smollm = Tokenizer(tokens, merges, pre="smollm")
    assert gpt2.encode(" 1") == [len(alphabet)]
    assert len(smollm.encode(" 1")) == 2
    assert gpt2.token_bytes(len(alphabet)) == b" 1"


def test_bad_ids(gguf_tokenizer):
    with pytest.raises(IndexError):
        gguf_tokenizer.token_bytes(gguf_tokenizer.vocab_size)
    with pytest.raises(IndexError):
        gguf_tokenizer.token_bytes(-1)
    with pytest.raises(IndexError):
        gguf_tokenizer.is_special(-1)


def test_hf_chat_template_is_found_where_transformers_saves_it(tmp_path):
    """chat_template.jinja first (transformers >= 4.43 writes it), else tokenizer_config.json's
    string, else its "default" named template; None without one."""
    from engine.tokenizer import hf_chat_template

    assert hf_chat_template(tmp_path, {}) is None
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert hf_chat_template(tmp_path, config) == "D"
    assert hf_chat_template(tmp_path, {"chat_template": "S"}) == "S"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert hf_chat_template(tmp_path, {"chat_template": "S"}) == "{{ messages[0]['content'] }}"
