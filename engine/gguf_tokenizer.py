"""Tokenizers rebuilt from a GGUF file's metadata, as ``tokenizers.Tokenizer`` pipelines.

A GGUF carries no ``tokenizer.json``. It stores the vocabulary under llama.cpp's key names:
``tokenizer.ggml.model`` (the kind), ``.pre`` (the pre-tokenizer of a byte-level vocabulary),
``.tokens``, ``.scores``, ``.token_type`` (1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte), ``.merges`` (``"a b"`` strings, best first), the special ids
(``.bos_token_id``, ``.eos_token_id``, ``.unknown_token_id``, ``.padding_token_id``), the flags
``.add_bos_token``, ``.add_eos_token``, ``.add_space_prefix``, and ``tokenizer.chat_template``.
:func:`tokenizer_from_metadata` rebuilds from them the pipeline transformers builds for the same
file (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``, 5.x: the builders named below,
then ``add_gguf_special_tokens`` and ``set_split_regex``), in genserve's own code — transformers is
only the tests' reference. Two kinds are read:

``"gpt2"``: byte-level BPE (SmolLM2, Llama 3, Qwen2, Mistral Nemo ...)
    transformers' ``byte_level_tokenizer`` / ``GPT2Tokenizer``: BPE over the GPT-2 byte alphabet
    (every byte mapped to a printable character, space -> ``Ġ``), no unknown token; decoder: the
    byte map reversed. A normal token spelled outside that alphabet is respelled in it, as
    transformers does. The pre-tokenizer follows ``tokenizer.ggml.pre``
    (:func:`byte_level_pre_tokenizer`): the GPT-2 regex, the StarCoder family's digit split (what
    genserve has always done for SmolLM2, as llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` and SmolLM2's
    own ``tokenizer.json``; transformers does not split digits there), or a family's split regex
    (Llama 3, Qwen2, Tekken, GPT-4o: transformers' ``GGUF_PRE_TOKENIZER_SPLITS``, which copies
    llama.cpp's ``llama-vocab.cpp``) followed by the byte map. An unknown ``pre`` falls back to
    GPT-2 with a warning.

``"llama"``: SentencePiece BPE (Llama 2, Mistral 7B, Gemma, Phi-3)
    BPE over ``▁``-for-space pieces with byte fallback (``<0xNN>`` tokens for bytes no piece
    covers), ``fuse_unk``; decoder ``▁`` -> space, byte fallback, fuse. Merges come from the file
    when it has them, else are derived from the vocabulary (:func:`derive_merges`, as
    ``transformers.tokenization_utils_base.generate_merges``). By ``general.architecture``:

    * default (transformers' ``LlamaTokenizer``): ``Metaspace`` pre-tokenizer, prepend scheme
      ``"first"`` (a ``▁`` before the text's start only, not after a special token), and a decoder
      that strips that one leading space; merges ranked by score.
    * ``phi3`` (transformers' ``phi3_tokenizer``): the prefix ``▁`` comes from a normalizer
      (``Prepend("▁")`` then space -> ``▁``), so it also follows every special token.
    * ``gemma``/``gemma2``/``gemma3`` (transformers' ``gemma_tokenizer`` / ``GemmaTokenizer``): no
      prefix; normalizer space -> ``▁``; a token of real spaces (the file stores Gemma's ``▁▁``...
      tokens as ``"  "``...) is respelled with ``▁``; merges ranked by file position, not by
      score (Gemma's scores do not follow its merge order).

    ``tokenizer.ggml.add_space_prefix = false`` turns the prefix off (llama.cpp reads the flag;
    transformers ignores it: no published Llama/Mistral/Phi-3 file sets it false).

Special tokens (both kinds): control (3) and unknown (2) tokens are added as special tokens, matched
whole in text (llama.cpp parses those types as special; transformers adds the control tokens and
its ``unk_token``); user-defined (4) tokens are added as plain added tokens, also matched whole
(transformers' ``add_gguf_special_tokens``). Each keeps the file's spelling even in a byte-level
vocabulary, where transformers respells one outside the byte alphabet (DeepSeek's
``<｜begin▁of▁sentence｜>``) and then cannot match it: llama.cpp matches it whole, as here.
``add_bos_token`` defaults to true for ``"llama"`` with a BOS id (llama.cpp does so for
SentencePiece, and transformers follows: Llama 2 files predate the flag) and to false for
``"gpt2"``; ``add_eos_token`` defaults to false.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

#: ``tokenizer.ggml.model`` values this module reads.
SUPPORTED_MODELS = ("gpt2", "llama")

#: ``general.architecture`` values whose SentencePiece files are Gemma's (transformers'
#: ``GGUF_SENTENCEPIECE_BUILDERS``).
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

SPACE_PIECE = "\u2581"  # ▁, SentencePiece's space

# ``tokenizer.ggml.pre`` values whose digits are split one by one before the GPT-2 regex
# (llama.cpp ``llama-vocab.cpp``: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA).
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell",
                             "exaone", "minerva-7b"})

# ``pre`` values that are the plain GPT-2 regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2).
GPT2_PRE = frozenset({"gpt2", "gpt-2", "phi-2"})

# The split regexes of transformers' ``GGUF_PRE_TOKENIZER_SPLITS`` (llama.cpp ``llama-vocab.cpp``).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` -> the regex that splits text before the byte map.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), GPT4O_SPLIT),
}

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 ``encoder.py``).

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves; the other
    68 bytes map, in order, to ``chr(256)``, ``chr(257)`` ... (so space 0x20 -> ``Ġ`` U+0120).
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class GGUFTokenizer:
    """What :func:`tokenizer_from_metadata` reads from a file.

    Attributes:
        tokenizer: the ``tokenizers`` pipeline; its ids are the file's.
        token_bytes: the bytes each id stands for (control and user-defined tokens: their text).
        token_types: the file's token types, with the special tokens (control and unknown) as
            ``TOKEN_CONTROL``.
        bos_token_id, eos_token_id, unk_token_id, pad_token_id: the file's ids, None when absent
            or outside the vocabulary.
        add_bos_token, add_eos_token: whether an encoded prompt starts with BOS / ends with EOS.
        chat_template: ``tokenizer.chat_template``, or None.
    """

    tokenizer: HFTokenizer
    token_bytes: list[bytes]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def tokenizer_from_metadata(meta: Mapping[str, Any], name: str = "model.gguf") -> GGUFTokenizer:
    """Build the tokenizer a GGUF file's metadata describes (module docstring for each kind).

    Args:
        meta: metadata key -> value (``GGUFReader.fields[key].contents()``) for the keys the file
            has; ``tokenizer.ggml.model`` and ``tokenizer.ggml.tokens`` are required.
        name: the file's name, for error messages.

    Raises:
        KeyError: ``tokenizer.ggml.model`` or ``tokenizer.ggml.tokens`` missing; a byte-level file
            without ``tokenizer.ggml.merges``; a SentencePiece file with neither merges nor
            ``tokenizer.ggml.scores``.
        ValueError: ``tokenizer.ggml.model`` is not one of :data:`SUPPORTED_MODELS`; the token
            types or scores are not one per token; ``add_bos_token`` / ``add_eos_token`` is set
            without a valid BOS / EOS id.
    """
    def required(key: str):
        if key not in meta:
            raise KeyError(f"{name}: metadata key {key!r} missing")
        return meta[key]

    kind = required("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ValueError(f"{name}: tokenizer.ggml.model is {kind!r}; genserve reads "
                         f"{', '.join(repr(k) for k in SUPPORTED_MODELS)} (byte-level BPE, "
                         "SentencePiece BPE)")
    tokens = list(required("tokenizer.ggml.tokens"))
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * n
    if len(types) != n:
        raise ValueError(f"{name}: {len(types)} token types for {n} tokens")

    def special_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < n:  # llama.cpp warns and ignores such an id too
            log.warning("%s: tokenizer.ggml.%s %s is outside the vocabulary of %d; ignored",
                        name, key, value, n)
            return None
        return int(value)

    bos, eos = special_id("bos_token_id"), special_id("eos_token_id")
    unk, pad = special_id("unknown_token_id"), special_id("padding_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = (kind == "llama" and bos is not None) if add_bos is None else bool(add_bos)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    for flag, tid, what in ((add_bos, bos, "bos"), (add_eos, eos, "eos")):
        if flag and tid is None:
            raise ValueError(f"{name}: tokenizer.ggml.add_{what}_token is set but the file has no "
                             f"valid {what}_token_id")
    merges = meta.get("tokenizer.ggml.merges")
    if kind == "gpt2":
        if merges is None:
            raise KeyError(f"{name}: metadata key 'tokenizer.ggml.merges' missing")
        tk, token_bytes = byte_level_bpe(tokens, list(merges), types,
                                         pre=meta.get("tokenizer.ggml.pre") or "gpt2")
    else:
        scores = meta.get("tokenizer.ggml.scores")
        architecture = meta.get("general.architecture", "llama")
        if merges is None and scores is None and architecture not in GEMMA_ARCHITECTURES:
            raise KeyError(f"{name}: a SentencePiece vocabulary needs 'tokenizer.ggml.merges' or "
                           "'tokenizer.ggml.scores' to rank its merges; the file has neither")
        if scores is not None and len(scores) != n:
            raise ValueError(f"{name}: {len(scores)} scores for {n} tokens")
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
        tk, token_bytes = sentencepiece_bpe(
            tokens, types, scores=None if scores is None else [float(s) for s in scores],
            merges=None if merges is None else list(merges), architecture=architecture,
            add_space_prefix=True if add_prefix is None else bool(add_prefix),
            unk_token_id=unk)
    return GGUFTokenizer(
        tokenizer=tk, token_bytes=token_bytes,
        token_types=[TOKEN_CONTROL if t == TOKEN_UNKNOWN else t for t in types],
        bos_token_id=bos, eos_token_id=eos, unk_token_id=unk, pad_token_id=pad,
        add_bos_token=add_bos, add_eos_token=add_eos,
        chat_template=meta.get("tokenizer.chat_template"))


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE vocabulary whose ``tokenizer.ggml.pre`` is ``pre``.

    * a key of :data:`PRE_TOKENIZER_SPLITS` (``llama-bpe``, ``qwen2``, ``tekken``, ``gpt-4o`` ...):
      ``Split(regex, "isolated")`` then the byte map without the GPT-2 regex, as transformers'
      ``set_split_regex`` and those models' ``tokenizer.json``;
    * :data:`DIGIT_SPLIT_PRE` (``smollm`` ...): every digit on its own, then the GPT-2 regex and the
      byte map (llama.cpp's regexes ``\\p{N}`` then GPT-2's; SmolLM2's ``tokenizer.json``);
    * ``gpt2`` and anything else: the GPT-2 regex and the byte map; a value not in
      :data:`GPT2_PRE` is logged as a warning, since its model may split text otherwise.
    """
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in GPT2_PRE:
        log.warning("tokenizer.ggml.pre %r is not one genserve knows; splitting text with the "
                    "GPT-2 regex, which may differ from the model's own tokenizer", pre)
    return byte_level


def _add_special_tokens(tk: HFTokenizer, tokens: Sequence[str], types: Sequence[int],
                        in_vocab: Mapping[str, int]) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added
    tokens (each only where the vocabulary holds its spelling, so no id is created)."""
    special = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN) and t in in_vocab]
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED and t in in_vocab]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                   pre: str = "gpt2") -> tuple[HFTokenizer, list[bytes]]:
    """A ``"gpt2"`` file's tokenizer and the bytes of each token.

    Args:
        tokens: token strings by id, normal ones spelled in the GPT-2 byte alphabet
            (:func:`bytes_to_unicode`), special ones as their text.
        merges: ``"left right"`` merges, best first.
        token_types: GGUF token types per id.
        pre: ``tokenizer.ggml.pre`` (:func:`byte_level_pre_tokenizer`).

    Returns:
        ``(tokenizer, token_bytes)``: a normal token's bytes are the byte map reversed (a token
        outside the alphabet: its UTF-8, and it is respelled in the alphabet in the vocabulary,
        as transformers' ``byte_level_tokenizer``); a ``<0xNN>`` byte token (type 6) the byte NN;
        control, unknown and user-defined tokens their UTF-8 text.

    Raises:
        ValueError: the vocabulary is longer than its token ids (a spelling repeated), so the
            added tokens would create ids the model has not got.
    """
    byte_encoder = bytes_to_unicode()
    byte_decoder = {c: b for b, c in byte_encoder.items()}
    alphabet = set(byte_decoder)
    vocab: dict[str, int] = {}
    token_bytes: list[bytes] = []
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        match = _BYTE_TOKEN.fullmatch(token) if kind == TOKEN_BYTE else None
        if match:
            token_bytes.append(bytes([int(match.group(1), 16)]))
        elif kind in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
            token_bytes.append(token.encode("utf-8"))
        elif set(token) <= alphabet:
            token_bytes.append(bytes(byte_decoder[c] for c in token))
        else:
            token_bytes.append(token.encode("utf-8"))
            token = "".join(byte_encoder[b] for b in token_bytes[-1])
        vocab[token] = i
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                     fuse_unk=False, byte_fallback=False)
    tk = HFTokenizer(bpe)
    tk.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    _add_special_tokens(tk, tokens, token_types, vocab)
    if tk.get_vocab_size(with_added_tokens=True) > len(tokens):
        raise ValueError("added tokens grew the vocabulary: a control/user token is not in it")
    return tk, token_bytes


def respell_gemma_spaces(tokens: Sequence[str]) -> list[str]:
    """Gemma's whitespace tokens as its tokenizer spells them: a token of only whitespace with a
    space in it becomes that many ``▁`` (the file stores ``▁▁`` as two real spaces), as
    transformers' ``gemma_tokenizer``."""
    return [SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]


def derive_merges(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges recovered from a vocabulary that lists none, best first.

    Every way to cut a token into two vocabulary tokens is a merge; the merges are sorted by the
    token's rank (highest first), then by the longer left piece, then the longer right piece; ties
    keep the ranks' order. This is ``transformers.tokenization_utils_base.generate_merges(vocab,
    ranks)`` (what transformers does for a GGUF without merges), which also orders each token's
    own cuts by their pieces' ids first; that order never shows, since two cuts of one token
    differ in their left piece's length. Gemma 3's 262,144 tokens give 514,906 merges in about
    1-2 s.

    Args:
        vocab: token -> id.
        ranks: token -> score (higher merges first); its iteration order breaks ties.

    Returns:
        ``(left, right)`` pairs, highest priority first.
    """
    found: list[tuple[float, int, int, str, str]] = []
    append = found.append
    for token, rank in ranks.items():
        n = len(token)
        for i in range(1, n):
            left = token[:i]
            if left in vocab:
                right = token[i:]
                if right in vocab:
                    append((rank, i, n - i, left, right))
    found.sort(key=itemgetter(0, 1, 2), reverse=True)
    return [(m[3], m[4]) for m in found]


def sentencepiece_bpe(tokens: Sequence[str], token_types: Sequence[int], *,
                      scores: Sequence[float] | None, merges: Sequence[str] | None,
                      architecture: str = "llama", add_space_prefix: bool = True,
                      unk_token_id: int | None = None) -> tuple[HFTokenizer, list[bytes]]:
    """A ``"llama"`` (SentencePiece) file's tokenizer and the bytes of each token.

    Args:
        tokens: pieces by id, ``▁`` for a space; ``<0xNN>`` byte tokens (type 6).
        token_types: GGUF token types per id.
        scores: ``tokenizer.ggml.scores``, the merge ranks when ``merges`` is None (not for Gemma).
        merges: ``"left right"`` merges, best first, or None to derive them (:func:`derive_merges`).
        architecture: ``general.architecture``; Gemma's and ``phi3`` build differently (module
            docstring).
        add_space_prefix: ``tokenizer.ggml.add_space_prefix``: a ``▁`` before the text (not Gemma).
        unk_token_id: ``tokenizer.ggml.unknown_token_id``: the BPE's unknown token, used only for
            a byte no ``<0xNN>`` token covers (transformers leaves it unset for Llama files, whose
            256 byte tokens cover every byte).

    Returns:
        ``(tokenizer, token_bytes)``: a byte token's bytes are its byte; a normal piece's its text
        with ``▁`` as a space; control, unknown and user-defined tokens their UTF-8 text.

    Raises:
        ValueError: ``scores`` is None while ``merges`` is too, outside Gemma.
    """
    gemma = architecture in GEMMA_ARCHITECTURES
    spelled = respell_gemma_spaces(tokens) if gemma else list(tokens)
    vocab = {t: i for i, t in enumerate(spelled)}
    if merges is not None:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif gemma:
        pairs = derive_merges(vocab, {t: -i for i, t in enumerate(spelled)})
    elif scores is None:
        raise ValueError("no merges and no scores to derive them from")
    else:
        pairs = derive_merges(vocab, dict(zip(spelled, scores)))
    unk = tokens[unk_token_id] if unk_token_id is not None else None
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=unk,
                                fuse_unk=True, byte_fallback=True))
    decode = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tk.normalizer = normalizers.Replace(" ", SPACE_PIECE)
        tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    elif architecture == "phi3":
        replace = normalizers.Replace(" ", SPACE_PIECE)
        tk.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE_PIECE), replace])
                         if add_space_prefix else replace)
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE_PIECE, prepend_scheme="first" if add_space_prefix else "never",
            split=False)
    if add_space_prefix and not gemma:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(decode)
    _add_special_tokens(tk, tokens, token_types, vocab)

    token_bytes = []
    for token, kind in zip(tokens, token_types):
        match = _BYTE_TOKEN.fullmatch(token) if kind in (TOKEN_BYTE, TOKEN_NORMAL) else None
        if match:
            token_bytes.append(bytes([int(match.group(1), 16)]))
        elif kind in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED):
            token_bytes.append(token.encode("utf-8"))
        else:
            token_bytes.append(token.replace(SPACE_PIECE, " ").encode("utf-8"))
    return tk, token_bytes
