"""Tokenizers read from GGUF files (engine.gguf_tokenizer, Tokenizer.from_gguf), against the
reference: transformers' own GGUF tokenizer (``AutoTokenizer.from_pretrained(folder,
gguf_file=name)``) reading the same file.

Files: the published Gemma 3 270M GGUF (SentencePiece, 262,144 tokens, merges derived from the
vocabulary in file order), and tiny files written here with ``gguf.GGUFWriter``: a Llama-2-style
SentencePiece vocabulary with scores and byte tokens (also as ``phi3``), and byte-level BPE
vocabularies under each ``tokenizer.ggml.pre`` genserve knows.
"""

from __future__ import annotations

import logging
import pathlib
import random
import time

import numpy as np
import pytest

from engine import gguf_tokenizer
from engine.gguf_tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN,
                                   TOKEN_USER_DEFINED, bytes_to_unicode, derive_merges)
from engine.tokenizer import Tokenizer

pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "emoji 😀🎉 and a family 👨‍👩‍👧 and a flag 🇫🇷",
    "中文测试：你好，世界！日本語のテキストと한국어",
    "Ünïcödé café naïve façade Æsir, Привет, мир, Γειά σου",
    "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)\n\n\n",
    "a  b   c    d     e\t\tf\n \n  \n",
    "Digits 0123456789 and 3.14159, 1,000,000 and 2024-06-01; x² + ½ + ١٢٣",
    "I'm sure they'll say we'd've done it, DON'T YOU'RE",
    "   leading spaces and trailing   ",
    " ",
    "",
    "https://example.com/path?q=a&b=%20c#frag",
]

# Text with each family's special-token spellings (control, unknown, user-defined) in it.
GEMMA_SPECIAL_TEXTS = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> then <pad><unk><mask> and [multimodal] <unused0>",
    "half <start_of_turn and <end_of_turn>> nested",
]


def hf_tokenizer(path: pathlib.Path):
    """transformers' tokenizer for the GGUF at ``path`` (the reference)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_gguf(path: pathlib.Path, *, model: str, tokens: list[str], types: list[int],
               arch: str = "llama", scores: list[float] | None = None,
               merges: list[str] | None = None, pre: str | None = None, **flags) -> pathlib.Path:
    """A GGUF with a tokenizer and the least transformers needs to read a config: a one-layer
    ``arch`` header and one tiny tensor (the token embedding). ``flags``: GGUFWriter ``add_*``
    calls, e.g. ``bos_token_id=1`` -> ``add_bos_token_id(1)``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    for key, value in flags.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- a tiny Llama-2-style SentencePiece vocabulary ------------------------------------------------

SPM_WORDS = ("the quick brown fox jumps over lazy dog hello world this is test of tokenizers "
             "code return def fib café naïve ünicode digits and then").split()
SPM_CJK = ["中", "文", "中文", "▁中文", "日", "本", "日本", "▁日本", "世界", "你好"]


def spm_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """``<unk> <s> </s>``, the 256 ``<0xNN>`` byte tokens, pieces cut from ``▁``-prefixed words
    (the most frequent first, scored ``-rank`` as SentencePiece does), whitespace pieces, some CJK,
    then a control token and a user-defined one: what a Llama-2 GGUF holds, in small."""
    counts: dict[str, int] = {}
    for word in SPM_WORDS:
        piece = "▁" + word
        for length in range(2, 7):
            for i in range(len(piece) - length + 1):
                counts[piece[i:i + length]] = counts.get(piece[i:i + length], 0) + 1
    chars = sorted({c for p in counts for c in p} | set("abcdefghijklmnopqrstuvwxyzHT0123456789"))
    normal = sorted(counts, key=lambda p: (-counts[p], p)) + ["▁▁", "▁▁▁▁", "▁1", "12"] \
        + SPM_CJK + chars
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + normal \
        + ["<|im_start|>", "<think>"]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 \
        + [TOKEN_NORMAL] * len(normal) + [TOKEN_CONTROL, TOKEN_USER_DEFINED]
    scores = [0.0] * 259 + [-float(i) for i in range(len(normal))] + [0.0, 0.0]
    assert len(set(tokens)) == len(tokens)
    return tokens, types, scores


SPM_SPECIAL_TEXTS = [
    "<s>[INST] hi <|im_start|>assistant\n<think>the fox</think></s>",
    "<unk> and <0x41> written out, <s<s>>",
]

# --- a tiny byte-level BPE vocabulary ---------------------------------------------------------------

# Words the merges build, as text (spelled in the byte alphabet by bpe_vocabulary).
BPE_WORDS = ["Hello", " world", " the", " quick", " fox", " lazy", " dog", "'s", "'ll", " code",
             "  ", "   ", "    ", "\n\n", "\t\t", " \n", "12", "123", "1234", " 1", " 12", " 123",
             "00", "000", " (", "):", " +", " return", " fib", "def", " DON", "'T", "YOU", "caf",
             "café", "中", "中文", " 😀", "😀"]


def bpe_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """The 256 byte-alphabet characters, then each word of ``BPE_WORDS`` built left to right by
    merges (``"Hel" + "l"``...), then control tokens (Llama 3's, ChatML's) and a user-defined one."""
    byte_of = bytes_to_unicode()
    tokens, merges = sorted(byte_of.values()), []
    for word in BPE_WORDS:
        word = "".join(byte_of[b] for b in word.encode())
        for end in range(2, len(word) + 1):
            if word[:end] not in tokens:
                tokens.append(word[:end])
                merges.append(f"{word[:end - 1]} {word[end - 1]}")
    normal = len(tokens)
    tokens += ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types = [TOKEN_NORMAL] * normal + [TOKEN_CONTROL] * 4 + [TOKEN_USER_DEFINED]
    return tokens, types, merges


BPE_SPECIAL_TEXTS = [
    "<|begin_of_text|><|im_start|>user\nHello world<|im_end|>\n<think>the fox</think><|eot_id|>",
    "<|im_start <|eot_id|>> half",
]

BPE_PRES = ["llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "qwen2",
            "deepseek-r1-qwen", "tekken", "gpt-4o", "llama4", "gpt2"]


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_reader():
    """The published Gemma 3 270M GGUF's parsed header (~10 s: 262,144 token strings; parsed once
    per test process, shared with the model tests)."""
    from tests.gguf_assets import gemma3_270m_reader   # a missing package fails (the bootstrap installs it)

    return gemma3_270m_reader()


@pytest.fixture(scope="module")
def gemma(gemma_reader):
    """``(ours, transformers')`` for the Gemma 3 270M GGUF (~20 s for transformers' reader, once
    per test process: the model tests use the same tokenizer)."""
    from tests.gguf_assets import gemma3_270m_hf_tokenizer

    return Tokenizer.from_gguf(gemma_reader), gemma3_270m_hf_tokenizer()


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    """name -> path of the tiny SentencePiece GGUFs."""
    folder = tmp_path_factory.mktemp("spm")
    tokens, types, scores = spm_vocabulary()
    common = dict(model="llama", tokens=tokens, types=types, scores=scores, bos_token_id=1,
                  eos_token_id=2, unk_token_id=0)
    return {
        # Llama 2 files predate add_bos_token: absent means true
        "llama": write_gguf(folder / "llama.gguf", **common,
                            chat_template="{{ bos_token }}{% for m in messages %}[INST] "
                                          "{{ m['content'] }} [/INST]{% endfor %}"),
        "llama-eos": write_gguf(folder / "llama-eos.gguf", **common, add_bos_token=False,
                                add_eos_token=True),
        "phi3": write_gguf(folder / "phi3.gguf", **common, arch="phi3", add_bos_token=True),
    }


@pytest.fixture(scope="module")
def spm_pairs(spm_files):
    return {name: (Tokenizer.from_gguf(path), hf_tokenizer(path)) for name, path in spm_files.items()}


@pytest.fixture(scope="module")
def bpe_pairs(tmp_path_factory):
    """pre -> (ours, transformers') for tiny byte-level BPE GGUFs, one per ``pre`` value."""
    folder = tmp_path_factory.mktemp("bpe")
    tokens, types, merges = bpe_vocabulary()
    bos = tokens.index("<|begin_of_text|>")
    pairs = {}
    for pre in BPE_PRES:
        path = write_gguf(folder / f"{pre}.gguf", model="gpt2", pre=pre, tokens=tokens, types=types,
                          merges=merges, bos_token_id=bos, eos_token_id=bos + 1,
                          add_bos_token=pre.startswith("llama"))
        pairs[pre] = Tokenizer.from_gguf(path), hf_tokenizer(path)
    return pairs


def check_same_as_transformers(ours: Tokenizer, theirs, texts: list[str]) -> None:
    """Ids (with BOS/EOS as each adds them) and decoding, with and without the special tokens,
    equal transformers' for every text."""
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == \
            theirs.decode(ids, skip_special_tokens=True), text


# --- Gemma 3 ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS + GEMMA_SPECIAL_TEXTS)
def test_gemma3_ids_and_decoding_equal_transformers(gemma, text):
    check_same_as_transformers(*gemma, [text])


@pytest.mark.slow
def test_gemma3_metadata_and_token_bytes(gemma):
    tok, theirs = gemma
    assert tok.vocab_size == len(tok) == 262144
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (2, 1, 3, 0)
    assert tok.add_bos_token is True and tok.add_eos_token is False
    assert [tok.id_to_token(i) for i in (2, 105, 106)] == ["<bos>", "<start_of_turn>", "<end_of_turn>"]
    assert tok.is_special(105) and tok.is_special(1) and not tok.is_special(107)  # 107: "\n" user
    assert tok.encode("<start_of_turn>") == [2, 105]
    assert tok.encode_text("<start_of_turn>")[:1] != [105]
    # the file's "  " (user-defined) is the piece "▁▁": two spaces either way
    assert tok.id_to_token(138) == "▁▁" and tok.token_bytes(138) == b"  "
    assert tok.token_bytes(107) == b"\n" and tok.token_bytes(238) == b"\x00"
    assert tok.id_to_token(238) == "<0x00>"
    assert tok.token_bytes(tok.encode("Hello world")[2]) == b" world"
    assert tok.chat_template is None and theirs.chat_template is None  # this file carries none


@pytest.mark.slow
def test_gemma3_round_trips(gemma):
    """Without a prefix space, every text comes back from its ids, and from its tokens' bytes.
    (Not a text with "▁" in it: SentencePiece reads that as a space, transformers too.)"""
    tok, _ = gemma
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 0x3000) if not 0xD800 <= c < 0xE000 and c != 0x2581] + \
        ["😀", "🇫🇷", "\n", "\t", " ", " ", "7"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
                     for _ in range(200)]
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids[1:]) == text
        assert b"".join(tok.token_bytes(i) for i in ids[1:]).decode("utf-8") == text


@pytest.mark.slow
def test_gemma3_merges_are_transformers_generate_merges(gemma_reader):
    """No merges in the file: derived from the vocabulary, ranked by file position, exactly as
    transformers' generate_merges (and fast: ~1-2 s for 514,906 merges)."""
    from transformers.tokenization_utils_base import generate_merges

    tokens = gemma_reader.fields["tokenizer.ggml.tokens"].contents()
    spelled = gguf_tokenizer.respell_gemma_spaces(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    ranks = {t: -i for i, t in enumerate(spelled)}
    start = time.perf_counter()
    ours = derive_merges(vocab, ranks)
    seconds = time.perf_counter() - start
    assert ours == generate_merges(vocab, ranks)
    assert len(ours) == 514906
    assert seconds < 30, f"deriving Gemma's merges took {seconds:.1f} s"


# --- tiny SentencePiece files -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama-eos", "phi3"])
def test_sentencepiece_ids_and_decoding_equal_transformers(spm_pairs, name):
    check_same_as_transformers(*spm_pairs[name], TEXTS + SPM_SPECIAL_TEXTS)


def test_sentencepiece_flags_and_special_tokens(spm_pairs, spm_files):
    tok, _ = spm_pairs["llama"]
    tokens, types, _ = spm_vocabulary()
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, None)
    assert tok.add_bos_token is True and tok.add_eos_token is False   # absent: true, as llama.cpp
    assert tok.chat_template.startswith("{{ bos_token }}")
    fox = tokens.index("▁fox")
    assert tok.encode("fox") == [1, fox]
    assert tok.encode("<s>") == [1, 1] and tok.encode("<unk>") == [1, 0]
    assert tok.is_special(0) and tok.is_special(1) and tok.is_special(len(tokens) - 2)
    assert not tok.is_special(len(tokens) - 1) and not tok.is_special(fox)
    think = len(tokens) - 1
    assert tok.encode("<think>")[1:] == [think]          # user-defined: whole, not special
    assert think in tok.encode_text("<think>") and 1 not in tok.encode_text("<s>")
    eos_tok, _ = spm_pairs["llama-eos"]
    assert eos_tok.encode("fox") == [fox, 2] and eos_tok.encode_text("fox") == [fox]
    assert eos_tok.encode_batch(["fox", ""]) == [[fox, 2], [2]]


def test_sentencepiece_token_bytes(spm_pairs):
    """▁ is a space, <0xNN> is byte NN, control tokens are their text; a CJK character no piece
    holds is three byte tokens whose bytes join to it."""
    tok, _ = spm_pairs["llama"]
    tokens, _, _ = spm_vocabulary()
    assert tok.token_bytes(tokens.index("▁fox")) == b" fox"
    assert tok.token_bytes(3 + 0x41) == b"A" and tok.token_bytes(3 + 0xE4) == b"\xe4"
    assert tok.id_to_token(3 + 0x41) == "<0x41>"
    assert tok.token_bytes(1) == b"<s>" and tok.token_bytes(0) == b"<unk>"
    ids = tok.encode_text("語")
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xE8>", "<0xAA>", "<0x9E>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " 語".encode()
    for text in TEXTS:  # Metaspace puts a ▁ first unless the text starts with a space
        ids = tok.encode_text(text)
        expected = text if text.startswith(" ") or not text else " " + text
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == expected


def test_phi3_prefix_follows_special_tokens(spm_pairs):
    """phi3 puts its ▁ by a normalizer, so after a control token too; Llama's Metaspace only
    before the text's start (transformers' phi3_tokenizer docstring)."""
    tokens, _, _ = spm_vocabulary()
    start, fox = tokens.index("<|im_start|>"), tokens.index("▁fox")
    phi3, _ = spm_pairs["phi3"]
    llama, _ = spm_pairs["llama"]
    assert phi3.encode("<|im_start|>fox") == [1, start, fox]
    assert llama.encode("<|im_start|>fox")[:2] == [1, start]
    assert fox not in llama.encode("<|im_start|>fox")


def test_sentencepiece_chat_prompt_equals_transformers_apply_chat_template(spm_pairs):
    """The file's ``tokenizer.chat_template`` is what service.chat renders, as a Hugging Face
    checkpoint's; the prompt's ids are transformers' ``apply_chat_template`` after the BOS
    ``encode_pieces`` adds (validation drops the second of two BOS): no second ▁ after ``<s>``.
    A message's "<s>" stays text, where transformers, encoding the whole string, reads a BOS."""
    from genserve.common.chat_messages import parse_messages
    from service.chat import template_for

    tok, theirs = spm_pairs["llama"]
    template = template_for(tok)
    for content in ("the fox", "  two  spaces\n中文 😀", "the <s> fox", "中文😀 <s> fox"):
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
        ids = tok.encode_pieces(template.render_pieces(parse_messages(messages)))
        expected = [int(i) for i in theirs.apply_chat_template(messages, tokenize=True,
                                                                return_dict=False)]
        assert ids[:2] == [1, 1]
        if "<s>" in content:
            # ours: the message's "<s>" is text (no BOS id after the first; it decodes back as the
            # message's own characters); transformers' string encoding turns it into a BOS
            assert 1 not in ids[2:], ids
            assert content in tok.decode(ids[1:]), tok.decode(ids[1:])
            assert expected.count(1) == 2
        else:
            assert ids[1:] == expected


def test_sentencepiece_without_space_prefix(tmp_path):
    """``tokenizer.ggml.add_space_prefix = false``: no ``▁`` before the text and none stripped
    when decoding (llama.cpp reads the flag; transformers' LlamaTokenizer ignores it)."""
    tokens, types, scores = spm_vocabulary()
    path = write_gguf(tmp_path / "noprefix.gguf", model="llama", tokens=tokens, types=types,
                      scores=scores, bos_token_id=1, eos_token_id=2, add_space_prefix=False)
    tok = Tokenizer.from_gguf(path)
    with_prefix = Tokenizer.from_gguf(write_gguf(
        tmp_path / "prefix.gguf", model="llama", tokens=tokens, types=types, scores=scores,
        bos_token_id=1, eos_token_id=2))
    assert [tok.id_to_token(i) for i in tok.encode("fox jumps")] == ["<s>", "fox", "▁jumps"]
    assert [with_prefix.id_to_token(i) for i in with_prefix.encode("fox jumps")] == \
        ["<s>", "▁fox", "▁jumps"]
    assert tok.decode(tok.encode(" fox"), skip_special_tokens=True) == " fox"
    assert with_prefix.decode(with_prefix.encode(" fox"), skip_special_tokens=True) == "fox"


# --- tiny byte-level BPE files ------------------------------------------------------------------


@pytest.mark.parametrize("pre", BPE_PRES)
def test_byte_level_ids_and_decoding_equal_transformers(bpe_pairs, pre):
    check_same_as_transformers(*bpe_pairs[pre], TEXTS + BPE_SPECIAL_TEXTS)


def test_byte_level_pre_tokenizers_differ_where_their_regexes_do(bpe_pairs):
    """Digits: GPT-2 keeps " 1234" together, Llama 3 cuts digits in threes, Qwen2 one by one."""
    tokens, _, _ = bpe_vocabulary()

    def pieces(pre: str, text: str) -> list[str]:
        return [bpe_pairs[pre][0].id_to_token(i) for i in bpe_pairs[pre][0].encode_text(text)]

    assert pieces("gpt2", " 1234") == ["Ġ", "1234"]   # "1 2" outranks "Ġ 1"
    assert pieces("llama-bpe", " 1234") == ["Ġ", "123", "4"]
    assert pieces("qwen2", " 1234") == ["Ġ", "1", "2", "3", "4"]
    assert pieces("llama-bpe", "'s") == ["'s"] and pieces("gpt-4o", "fox's") == ["f", "o", "x", "'s"]
    assert bpe_pairs["llama-bpe"][0].add_bos_token and not bpe_pairs["qwen2"][0].add_bos_token
    assert bpe_pairs["llama-bpe"][0].encode("fox")[0] == tokens.index("<|begin_of_text|>")


def test_byte_level_special_tokens(bpe_pairs):
    tok, _ = bpe_pairs["qwen2"]
    tokens, _, _ = bpe_vocabulary()
    im_start, think = tokens.index("<|im_start|>"), tokens.index("<think>")
    assert tok.encode("<|im_start|>") == [im_start] and tok.is_special(im_start)
    assert tok.encode("<think>") == [think] and not tok.is_special(think)
    assert im_start not in tok.encode_text("<|im_start|>")
    assert tok.token_bytes(im_start) == b"<|im_start|>"
    assert tok.token_bytes(tokens.index("Ġworld")) == b" world"


def test_unknown_pre_falls_back_to_gpt2_with_a_warning(tmp_path, caplog):
    tokens, types, merges = bpe_vocabulary()
    path = write_gguf(tmp_path / "odd.gguf", model="gpt2", pre="no-such-pre", tokens=tokens,
                      types=types, merges=merges)
    plain = Tokenizer(tokens, merges, types, pre="gpt2")
    with caplog.at_level(logging.WARNING, logger="engine.gguf_tokenizer"):
        tok = Tokenizer.from_gguf(path)
    assert any("no-such-pre" in r.getMessage() for r in caplog.records)
    for text in TEXTS:
        assert tok.encode(text) == plain.encode(text)


# --- bad metadata -------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_a_clear_error(tmp_path):
    path = write_gguf(tmp_path / "rwkv.gguf", model="rwkv", tokens=["a", "b"],
                      types=[TOKEN_NORMAL] * 2)
    with pytest.raises(ValueError) as err:
        Tokenizer.from_gguf(path)
    message = str(err.value)
    assert "rwkv.gguf" in message and "'rwkv'" in message
    assert "'gpt2'" in message and "'llama'" in message


def test_missing_vocabulary_pieces_are_key_errors():
    with pytest.raises(KeyError, match="tokenizer.ggml.tokens"):
        gguf_tokenizer.tokenizer_from_metadata({"tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(KeyError, match="scores"):
        gguf_tokenizer.tokenizer_from_metadata(
            {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    with pytest.raises(KeyError, match="merges"):
        gguf_tokenizer.tokenizer_from_metadata(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    with pytest.raises(ValueError, match="add_bos_token"):
        gguf_tokenizer.tokenizer_from_metadata(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
             "tokenizer.ggml.merges": [], "tokenizer.ggml.add_bos_token": True}, "x.gguf")


def test_derive_merges_orders_as_transformers():
    """Every cut of a token into two vocabulary tokens, by score, then longer left, then longer
    right; a token's cuts by their pieces' ids; ties in file order."""
    from transformers.tokenization_utils_base import generate_merges

    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "abca"])}
    scores = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -1.0, "abc": -2.0, "ca": -3.0,
              "cab": -1.0, "abca": -2.0}
    merges = derive_merges(vocab, scores)
    assert merges == [("ca", "b"), ("c", "ab"), ("a", "b"), ("b", "c"),
                      ("abc", "a"), ("ab", "ca"), ("ab", "c"), ("a", "bc"), ("c", "a")]
    assert merges == generate_merges(vocab, scores)


def test_derive_merges_equals_transformers_with_many_ties():
    """Random vocabularies over a 4-letter alphabet, scores drawn from 3 values (ties
    everywhere), duplicate spellings included: the same merges as transformers, in the same order."""
    from transformers.tokenization_utils_base import generate_merges

    rng = random.Random(7)
    for _ in range(30):
        tokens = ["".join(rng.choice("abc▁") for _ in range(rng.randint(1, 5))) for _ in range(150)]
        vocab = {t: i for i, t in enumerate(tokens)}
        scores = dict(zip(tokens, (rng.choice([0.0, -1.0, -2.5]) for _ in tokens)))
        assert derive_merges(vocab, scores) == generate_merges(vocab, scores)
        positions = {t: -i for i, t in enumerate(tokens)}
        assert derive_merges(vocab, positions) == generate_merges(vocab, positions)
