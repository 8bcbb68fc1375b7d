"""Byte-level BPE tokenizer read from a GGUF file (SmolLM2: ``tokenizer.ggml.model = "gpt2"``).

A GGUF carries no ``tokenizer.json``; it stores the vocabulary (``tokenizer.ggml.tokens``), the
merges (``tokenizer.ggml.merges``, ``"a b"`` strings, best first), the token types
(``tokenizer.ggml.token_type``: 1 normal, 3 control, 4 user-defined, 6 byte) and the special ids.
This module rebuilds the Hugging Face ``tokenizers`` pipeline from them:

* model: BPE over the GPT-2 byte alphabet (every byte mapped to a printable character, e.g.
  space -> ``Ġ``, newline -> ``Ċ``), no unknown token, no dropout;
* pre-tokenizer for ``tokenizer.ggml.pre = "smollm"``: split every digit on its own, then the GPT-2
  regex ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` and
  the byte map. This is llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` (regexes ``\\p{N}`` then the
  GPT-2 one, ``src/llama-vocab.cpp``) and SmolLM2's own ``tokenizer.json``
  (``Digits(individual_digits=True)`` + ``ByteLevel``). For ``"gpt2"`` and unknown ``pre`` values the
  digit split is left out (plain GPT-2);
* control tokens (``<|im_start|>``, ``<|im_end|>`` ...) are added as special tokens, so they are
  matched whole in the text, as transformers' ``GGUFGPTConverter`` / ``add_gguf_special_tokens`` do;
* decoder: the byte map reversed.

No BOS is added (the file says ``add_bos_token = false``).

``Tokenizer.from_hf_dir`` reads a Hugging Face checkpoint's ``tokenizer.json`` instead (byte-level
BPE as above, or SentencePiece-style BPE as Llama-2's, with ``▁`` for a space and ``<0xNN>`` byte
tokens). ``ByteTokenizer`` is the byte-level fallback of random-initialised models.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

if TYPE_CHECKING:
    import gguf

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# ``tokenizer.ggml.pre`` values whose digits are split one by one before the GPT-2 regex
# (llama.cpp ``llama-vocab.cpp``: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell",
                              "exaone", "minerva-7b"})


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




def _control_tokens(token_bytes: list[bytes], token_types: list[int]
                    ) -> tuple["re.Pattern[str] | None", dict[str, int]]:
    """A regular expression matching any control token's text (longest first, as the library
    matches added tokens) and text -> id; (None, {}) for a vocabulary without control tokens."""
    ids_of = {token_bytes[i].decode("utf-8", "replace"): i
              for i, kind in enumerate(token_types) if kind == TOKEN_CONTROL}
    if not ids_of:
        return None, {}
    return re.compile("|".join(re.escape(t) for t in sorted(ids_of, key=len, reverse=True))), ids_of

def _literal_copy(tk: _HFTokenizer) -> _HFTokenizer:
    """A copy of `tk` that reads special-token text as plain text (the library's
    `encode_special_tokens`), for `Tokenizer.encode_text`. A copy, so that `tk` itself never
    changes mode and both can be used at once."""
    copy = _HFTokenizer.from_str(tk.to_str())
    copy.encode_special_tokens = True
    return copy


def hf_chat_template(directory: pathlib.Path, tok_config: dict) -> str | None:
    """A Hugging Face checkpoint's chat template, as transformers finds it: the file
    ``chat_template.jinja`` (what transformers 4.43+ saves), else ``tokenizer_config.json``'s
    ``chat_template`` — a string, or a list of named templates of which the one named "default"
    is taken (the others, e.g. "tool_use", are for callers that ask by name). None: no template."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None

class Tokenizer:
    """Text <-> token ids for a byte-level BPE GGUF, plus the exact bytes of each token.

    Attributes:
        vocab_size: number of token ids (49,152 for SmolLM2), ids are ``0 .. vocab_size - 1``.
        bos_token_id: ``tokenizer.ggml.bos_token_id`` (1, ``<|im_start|>``), or None.
        eos_token_id: ``tokenizer.ggml.eos_token_id`` (2, ``<|im_end|>``), or None.
        chat_template: the file's Jinja chat template, or None.
        add_bos_token: whether :meth:`encode` prepends ``bos_token_id`` (False for SmolLM2).
    """

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                 *, pre: str = "gpt2", bos_token_id: int | None = None,
                 eos_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool = False):
        """Build from GGUF-style vocabulary arrays.

        Args:
            tokens: token strings indexed by id, spelled in the GPT-2 byte alphabet (control
                tokens as their text).
            merges: ``"left right"`` BPE merges, highest priority first.
            token_types: GGUF token types per id (1 normal, 3 control, 4 user-defined, 6 byte);
                None means all normal.
            pre: ``tokenizer.ggml.pre``; ``"smollm"`` (and the other StarCoder-style values)
                split digits individually.
            bos_token_id, eos_token_id: special ids from the file.
            chat_template: ``tokenizer.chat_template`` from the file.
            add_bos_token: ``tokenizer.ggml.add_bos_token``; when true, :meth:`encode` prepends
                ``bos_token_id`` (false for SmolLM2).

        Raises:
            ValueError: ``token_types`` length differs from ``tokens``, or a special id is out of range.
        """
        token_types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")
        for name, tid in (("bos", bos_token_id), ("eos", eos_token_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise ValueError(f"{name}_token_id {tid} outside the vocabulary of {len(tokens)}")
        self.vocab_size = len(tokens)
        self.add_bos_token = add_bos_token
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but there is no bos_token_id")
        self._bos = [bos_token_id] if add_bos_token else []
        self._types = token_types

        byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        alphabet = set(byte_decoder)

        def raw_bytes(token: str, kind: int) -> bytes:
            if kind == TOKEN_BYTE and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:-1], 16)])  # sentencepiece-style byte token
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or not set(token) <= alphabet:
                return token.encode("utf-8")
            return bytes(byte_decoder[c] for c in token)

        self._bytes = [raw_bytes(t, k) for t, k in zip(tokens, token_types)]

        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                         fuse_unk=False, byte_fallback=False)
        tk = _HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, normalized=False, special=True)
                    for t, k in zip(tokens, token_types) if k == TOKEN_CONTROL]
        user = [AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, token_types) if k == TOKEN_USER_DEFINED]
        tk.add_special_tokens(specials)
        tk.add_tokens(user)
        if tk.get_vocab_size(with_added_tokens=True) != self.vocab_size:
            raise ValueError("added tokens grew the vocabulary: a control/user token is not in it")
        self._tk = tk
        self._tk_text = _literal_copy(tk)
        self._control = _control_tokens(self._bytes, self._types)

    @classmethod
    def from_gguf(cls, source: "str | pathlib.Path | gguf.GGUFReader | None" = None) -> "Tokenizer":
        """Read the tokenizer metadata of a GGUF file (default: the embedded SmolLM2 model).

        ``source`` is a path, a reader from ``engine.model.weights.open_gguf`` (share one with
        ``load_gguf``: parsing SmolLM2's ~98k strings takes 1.5-2 s), or None for the default file.

        Raises:
            FileNotFoundError: no file at ``path`` (or the default package is missing).
            KeyError: the file has no ``tokenizer.ggml.tokens`` / ``merges``.
            ValueError: ``tokenizer.ggml.model`` is not ``"gpt2"`` (byte-level BPE).
        """
        import gguf

        from engine.model.weights import open_gguf

        reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
        path = pathlib.Path(getattr(reader.data, "filename", None) or "model.gguf")
        fields = reader.fields

        def meta(key: str, required: bool = False):
            if key not in fields:
                if required:
                    raise KeyError(f"{path.name}: metadata key {key!r} missing")
                return None
            return fields[key].contents()

        kind = meta("tokenizer.ggml.model", required=True)
        if kind != "gpt2":
            raise ValueError(f"{path.name}: tokenizer model {kind!r}, only byte-level BPE 'gpt2' "
                             "is supported")
        return cls(meta("tokenizer.ggml.tokens", required=True),
                   meta("tokenizer.ggml.merges", required=True),
                   meta("tokenizer.ggml.token_type"),
                   pre=meta("tokenizer.ggml.pre") or "gpt2",
                   bos_token_id=meta("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta("tokenizer.ggml.eos_token_id"),
                   chat_template=meta("tokenizer.chat_template"),
                   add_bos_token=bool(meta("tokenizer.ggml.add_bos_token")))

    @classmethod
    def from_hf_dir(cls, directory: str | pathlib.Path, vocab_size: int | None = None) -> "Tokenizer":
        """Read a Hugging Face checkpoint's tokenizer: ``tokenizer.json`` (the ``tokenizers``
        library's file), special ids from ``config.json``, the chat template from
        ``tokenizer_config.json`` when present.

        Token bytes: with a ``ByteLevel`` decoder (GPT-2 style), the byte map reversed; otherwise
        SentencePiece style: ``<0xNN>`` is byte NN and ``▁`` (U+2581) a space. Special tokens are
        the file's added tokens marked ``special``; they add no text to a stream. A BOS is
        prepended by :meth:`encode` when the file's post-processor adds one (Llama-2's does).

        Args:
            directory: holds ``tokenizer.json`` (and ``config.json``).
            vocab_size: the model's vocabulary when larger than the tokenizer's (padded embedding
                rows): the extra ids stand for no bytes. None: the tokenizer's own size.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``directory``.
            ValueError: the tokenizer has more ids than ``vocab_size``.
        """
        directory = pathlib.Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        tk = _HFTokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8"))
        n = tk.get_vocab_size(with_added_tokens=True)
        size = n if vocab_size is None else vocab_size
        if size < n:
            raise ValueError(f"{path}: {n} token ids, more than the model's vocabulary of {size}")

        def read(name: str) -> dict:
            f = directory / name
            return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}

        config, tok_config = read("config.json"), read("tokenizer_config.json")

        def special_id(key: str) -> int | None:
            value = config.get(key)
            value = value[0] if isinstance(value, list) and value else value
            return int(value) if isinstance(value, int) and 0 <= value < size else None

        bos, eos = special_id("bos_token_id"), special_id("eos_token_id")
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
        byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        token_bytes: list[bytes] = []
        for i in range(size):
            token = tk.id_to_token(i) if i < n else None
            if token is None:
                token_bytes.append(b"")
            elif i in special:
                token_bytes.append(token.encode("utf-8"))
            elif byte_level and set(token) <= byte_decoder.keys():
                token_bytes.append(bytes(byte_decoder[c] for c in token))
            elif not byte_level and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                token_bytes.append(bytes([int(token[3:5], 16)]))
            else:
                token_bytes.append(token.replace("\u2581", " ").encode("utf-8"))
        with_bos = tk.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and len(with_bos) > 1 and with_bos[0] == bos
        types = [TOKEN_CONTROL if i in special else TOKEN_NORMAL for i in range(size)]
        return cls._from_parts(tk, token_bytes, types, bos_token_id=bos, eos_token_id=eos,
                               chat_template=hf_chat_template(directory, tok_config),
                               add_bos_token=add_bos)

    @classmethod
    def _from_parts(cls, tk: _HFTokenizer, token_bytes: list[bytes], token_types: list[int], *,
                    bos_token_id: int | None, eos_token_id: int | None, chat_template: str | None,
                    add_bos_token: bool) -> "Tokenizer":
        self = cls.__new__(cls)
        self.vocab_size = len(token_bytes)
        self.add_bos_token = add_bos_token
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self._bos = [bos_token_id] if add_bos_token and bos_token_id is not None else []
        self._types = token_types
        self._bytes = token_bytes
        self._tk = tk
        self._tk_text = _literal_copy(tk)
        self._control = _control_tokens(token_bytes, token_types)
        return self

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. No BOS is added unless the file says so (SmolLM2 does not).
        Control-token text such as ``<|im_end|>`` becomes its single id (as in transformers and
        llama.cpp with special parsing)."""
        return self._bos + self._tk.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: control-token text such as ``<|im_end|>`` is
        tokenized like any other characters and never becomes a control id; no BOS. For text a
        user wrote inside a chat message (service/chat.py), which must not open or close turns."""
        return self._tk_text.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of the text the pieces join to, where control-token text is matched only
        in pieces whose flag is False (a chat template's own text), never in those flagged True
        (message text). Between two control tokens the text is tokenized as one run, as
        `encode` of the joined text would, so text without control-token spellings gives
        exactly `encode("".join(texts))`. A BOS as `encode` adds it."""
        pattern, ids_of = self._control
        ids = list(self._bos)
        run: list[str] = []
        for text, is_message in pieces:
            if is_message or pattern is None:
                run.append(text)
                continue
            pos = 0
            for match in pattern.finditer(text):
                run.append(text[pos:match.start()])
                ids += self.encode_text("".join(run))
                ids.append(ids_of[match.group()])
                run, pos = [], match.end()
            run.append(text[pos:])
        return ids + self.encode_text("".join(run))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, run in parallel by the Rust library."""
        return [self._bos + e.ids
                for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD. For streaming use
        :meth:`token_bytes` and decode only complete UTF-8 sequences."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes ``token_id`` stands for (the GPT-2 byte map reversed; control tokens
        give their UTF-8 text). One token may hold part of a multi-byte character.

        Raises:
            IndexError: ``token_id`` outside ``0 .. vocab_size - 1``.
        """
        if token_id < 0:
            raise IndexError(f"token id {token_id} is negative")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` ...).

        Raises:
            IndexError: ``token_id`` outside ``0 .. vocab_size - 1``.
        """
        if token_id < 0:
            raise IndexError(f"token id {token_id} is negative")
        return self._types[token_id] == TOKEN_CONTROL

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id`` (byte-alphabet spelling, e.g. ``ĠParis``)."""
        return self._tk.id_to_token(token_id)

    def __len__(self) -> int:
        return self.vocab_size


class ByteTokenizer:
    """The tokenizer of a random-initialised model: token id i stands for the byte i mod 256.

    Text encodes to its UTF-8 bytes (ids 0..255); any id of the model's vocabulary decodes (ids
    from 256 up repeat the byte table), so whatever a random model samples streams as bytes.
    No special tokens, no BOS, no EOS: a request runs to its max_tokens. The same interface as
    :class:`Tokenizer` (what the service, the detokenizer and validation use).

    Args:
        vocab_size: the model's vocabulary, at least 256.

    Raises:
        ValueError: ``vocab_size`` below 256.
    """

    bos_token_id = None
    eos_token_id = None
    chat_template = None
    add_bos_token = False

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of >= 256, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids 0..255."""
        return list(text.encode("utf-8"))

    def encode_text(self, text: str) -> list[int]:
        """As `encode`: a byte vocabulary has no control tokens to keep out."""
        return self.encode(text)

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """`encode` of the joined texts (no control tokens to keep out of message pieces)."""
        return self.encode("".join(text for text, _ in pieces))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The bytes of ``ids`` as UTF-8 text, invalid sequences as U+FFFD."""
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The byte ``token_id`` mod 256 stands for.

        Raises:
            IndexError: ``token_id`` outside ``0 .. vocab_size - 1``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} outside 0..{self.vocab_size - 1}")
        return bytes([token_id % 256])

    def is_special(self, token_id: int) -> bool:
        """Always False: a byte-level vocabulary has no control tokens."""
        return False

    def id_to_token(self, token_id: int) -> str:
        """The byte as ``<0xNN>``."""
        return f"<0x{token_id % 256:02X}>"

    def __len__(self) -> int:
        return self.vocab_size
