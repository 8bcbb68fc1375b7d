"""The model's tokenizer: text <-> token ids, and the exact bytes of every token.

:class:`Tokenizer` wraps a Hugging Face ``tokenizers`` pipeline, built from one of:

* a GGUF file's metadata (``Tokenizer.from_gguf``): byte-level BPE (``tokenizer.ggml.model =
  "gpt2"``: SmolLM2, Llama 3, Qwen2 ...) or SentencePiece BPE (``"llama"``: Llama 2, Mistral 7B,
  Gemma, Phi-3). The pipelines, which follow transformers' GGUF tokenizers, are built in
  :mod:`engine.gguf_tokenizer`;
* a Hugging Face checkpoint's ``tokenizer.json`` (``Tokenizer.from_hf_dir``): byte-level BPE, or
  SentencePiece-style BPE as Llama-2's, with ``▁`` for a space and ``<0xNN>`` byte tokens.

Control tokens (``<|im_start|>``, ``<start_of_turn>`` ...) are special: matched whole in text, and
:meth:`Tokenizer.is_special` is true for them. ``ByteTokenizer`` is the byte-level fallback of
random-initialised models.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as _HFTokenizer

from engine.gguf_file import open_gguf
from engine.gguf_tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL,  # noqa: F401 (re-exported)
                                   TOKEN_UNKNOWN, TOKEN_UNUSED, TOKEN_USER_DEFINED, bytes_to_unicode,
                                   byte_level_bpe, tokenizer_from_metadata)

if TYPE_CHECKING:
    import gguf

# The metadata keys ``Tokenizer.from_gguf`` reads (the others, tensors' among them, stay unparsed).
_GGUF_KEYS = ("general.architecture", "tokenizer.chat_template") + tuple(
    f"tokenizer.ggml.{k}" for k in (
        "model", "pre", "tokens", "scores", "token_type", "merges", "bos_token_id", "eos_token_id",
        "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token", "add_space_prefix"))


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
    changes mode and both can be used at once.

    The copy shares `tk`'s model, normalizer, pre-tokenizer and decoder (the library holds them
    behind reference-counted locks) and gets its own added tokens, which is what the mode changes:
    ~10 ms for Gemma 3's 262,144 tokens, where a round trip through JSON takes ~1.3 s. A tokenizer
    with truncation or padding set, or whose added tokens do not come back with their ids, is
    copied through JSON."""
    added = tk.get_added_tokens_decoder()
    copy = None
    if tk.truncation is None and tk.padding is None:
        copy = _HFTokenizer(tk.model)
        copy.normalizer, copy.pre_tokenizer = tk.normalizer, tk.pre_tokenizer
        copy.post_processor, copy.decoder = tk.post_processor, tk.decoder
        ordered = [added[i] for i in sorted(added)]
        copy.add_special_tokens([t for t in ordered if t.special])
        copy.add_tokens([t for t in ordered if not t.special])
        if copy.get_added_tokens_decoder() != added:
            copy = None
    if copy is None:
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
    """Text <-> token ids, plus the exact bytes of each token.

    Attributes:
        vocab_size: number of token ids (49,152 for SmolLM2), ids are ``0 .. vocab_size - 1``.
        bos_token_id: the BOS id (SmolLM2: 1, ``<|im_start|>``), or None.
        eos_token_id: the EOS id (SmolLM2: 2, ``<|im_end|>``), or None.
        unk_token_id, pad_token_id: the unknown and padding ids, or None.
        chat_template: the Jinja chat template (a GGUF's ``tokenizer.chat_template``, a Hugging
            Face checkpoint's :func:`hf_chat_template`), or None; ``service.chat.template_for``
            reads it.
        add_bos_token: whether :meth:`encode` prepends ``bos_token_id`` (False for SmolLM2, True
            for SentencePiece files unless they say otherwise).
        add_eos_token: whether :meth:`encode` appends ``eos_token_id``.
    """

    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_eos_token: bool = False

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None,
                 *, pre: str = "gpt2", bos_token_id: int | None = None,
                 eos_token_id: int | None = None, chat_template: str | None = None,
                 add_bos_token: bool = False):
        """Build a byte-level BPE tokenizer from GGUF-style vocabulary arrays
        (:func:`engine.gguf_tokenizer.byte_level_bpe`).

        Args:
            tokens: token strings indexed by id, spelled in the GPT-2 byte alphabet (control
                tokens as their text).
            merges: ``"left right"`` BPE merges, highest priority first.
            token_types: GGUF token types per id (1 normal, 3 control, 4 user-defined, 6 byte);
                None means all normal.
            pre: ``tokenizer.ggml.pre``; ``"smollm"`` (and the other StarCoder-style values)
                split digits individually, ``"llama-bpe"``, ``"qwen2"`` ... use their family's
                split regex (:func:`engine.gguf_tokenizer.byte_level_pre_tokenizer`).
            bos_token_id, eos_token_id: special ids from the file.
            chat_template: ``tokenizer.chat_template`` from the file.
            add_bos_token: ``tokenizer.ggml.add_bos_token``; when true, :meth:`encode` prepends
                ``bos_token_id`` (false for SmolLM2).

        Raises:
            ValueError: ``token_types`` length differs from ``tokens``, a special id is out of
                range, or ``add_bos_token`` without a ``bos_token_id``.
        """
        token_types = list(token_types) if token_types is not None else [TOKEN_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"{len(token_types)} token types for {len(tokens)} tokens")
        for name, tid in (("bos", bos_token_id), ("eos", eos_token_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise ValueError(f"{name}_token_id {tid} outside the vocabulary of {len(tokens)}")
        if add_bos_token and bos_token_id is None:
            raise ValueError("add_bos_token is set but there is no bos_token_id")
        tk, token_bytes = byte_level_bpe(tokens, merges, token_types, pre=pre)
        types = [TOKEN_CONTROL if t == TOKEN_UNKNOWN else t for t in token_types]
        self._setup(tk, token_bytes, types, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                    chat_template=chat_template, add_bos_token=add_bos_token)

    @classmethod
    def from_gguf(cls, source: "str | pathlib.Path | gguf.GGUFReader | None" = None) -> "Tokenizer":
        """Read the tokenizer a GGUF file describes (default: the embedded SmolLM2 model).

        Byte-level BPE (``tokenizer.ggml.model = "gpt2"``, with the pre-tokenizer
        ``tokenizer.ggml.pre`` names) and SentencePiece BPE (``"llama"``: Llama 2 / Mistral,
        Gemma, Phi-3), built as transformers builds them from the same file
        (:mod:`engine.gguf_tokenizer` has the rules and their sources). The special ids, the
        ``add_bos_token`` / ``add_eos_token`` flags and ``tokenizer.chat_template`` come from the
        file. Deriving a SentencePiece file's merges from its vocabulary (Gemma 3: 262,144 tokens)
        takes about a second.

        ``source`` is a path, a reader from ``engine.gguf_file.open_gguf`` (share one with
        ``load_gguf``: parsing SmolLM2's ~98k strings takes 1.5-2 s), or None for the default file.

        Raises:
            FileNotFoundError: no file at ``path`` (or the default package is missing).
            KeyError: the file has no ``tokenizer.ggml.model`` / ``tokens``, or no merges (and, for
                SentencePiece, no scores to derive them from).
            ValueError: ``tokenizer.ggml.model`` is neither ``"gpt2"`` nor ``"llama"`` (the
                message names the file and the value), or the token arrays disagree in length.
        """
        import gguf

        reader = source if isinstance(source, gguf.GGUFReader) else open_gguf(source)
        path = pathlib.Path(getattr(reader.data, "filename", None) or "model.gguf")
        meta = {key: reader.fields[key].contents() for key in _GGUF_KEYS if key in reader.fields}
        parts = tokenizer_from_metadata(meta, path.name)
        return cls._from_parts(parts.tokenizer, parts.token_bytes, parts.token_types,
                               bos_token_id=parts.bos_token_id, eos_token_id=parts.eos_token_id,
                               unk_token_id=parts.unk_token_id, pad_token_id=parts.pad_token_id,
                               chat_template=parts.chat_template, add_bos_token=parts.add_bos_token,
                               add_eos_token=parts.add_eos_token)

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
                    add_bos_token: bool, add_eos_token: bool = False,
                    unk_token_id: int | None = None, pad_token_id: int | None = None) -> "Tokenizer":
        self = cls.__new__(cls)
        self._setup(tk, token_bytes, token_types, bos_token_id=bos_token_id,
                    eos_token_id=eos_token_id, chat_template=chat_template,
                    add_bos_token=add_bos_token, add_eos_token=add_eos_token,
                    unk_token_id=unk_token_id, pad_token_id=pad_token_id)
        return self

    def _setup(self, tk: _HFTokenizer, token_bytes: list[bytes], token_types: list[int], *,
               bos_token_id: int | None, eos_token_id: int | None, chat_template: str | None,
               add_bos_token: bool, add_eos_token: bool = False,
               unk_token_id: int | None = None, pad_token_id: int | None = None) -> None:
        """Set every attribute; ``token_types`` marks the special ids ``TOKEN_CONTROL``."""
        self.vocab_size = len(token_bytes)
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._bos = [bos_token_id] if add_bos_token and bos_token_id is not None else []
        self._eos = [eos_token_id] if add_eos_token and eos_token_id is not None else []
        self._types = token_types
        self._bytes = token_bytes
        self._tk = tk
        self._tk_text = _literal_copy(tk)
        self._control: tuple[re.Pattern[str] | None, dict[str, int]] | None = None  # on first use

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: a BOS first when ``add_bos_token`` (SmolLM2: no; SentencePiece
        files: yes unless they say otherwise), an EOS last when ``add_eos_token``, as
        transformers' ``encode`` with special tokens. Control-token text such as ``<|im_end|>``
        becomes its single id (as in transformers and llama.cpp with special parsing)."""
        return self._bos + self._tk.encode(text, add_special_tokens=False).ids + self._eos

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: control-token text such as ``<|im_end|>`` is
        tokenized like any other characters and never becomes a control id; no BOS, no EOS. For
        text a user wrote inside a chat message (service/chat.py), which must not open or close
        turns."""
        return self._tk_text.encode(text, add_special_tokens=False).ids

    def control_token_in(self, text: str) -> str | None:
        """The first control token's text found in ``text`` (``<|im_end|>``), or None: for client
        data a chat template writes as its own text (tools, tool-call names and arguments), where
        such text would become a control token and could open or close turns."""
        if self._control is None:  # compiled once, as `encode_pieces` does
            self._control = _control_tokens(self._bytes, self._types)
        pattern, _ = self._control
        match = pattern.search(text) if pattern is not None else None
        return None if match is None else match.group()

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of the text the pieces join to, where control-token text is matched only
        in pieces whose flag is False (a chat template's own text), never in those flagged True
        (message text). A BOS as `encode` adds it, never an EOS (the ids are a prompt to
        continue).

        When no message piece holds control-token text this is `encode` of the joined text (without
        its EOS). Otherwise the text between two control tokens of the template is tokenized as
        one run with those spellings read as plain text; a SentencePiece tokenizer then puts its
        ``▁`` prefix before each run, where `encode` would put it before the first only."""
        pieces = list(pieces)
        joined = "".join(text for text, _ in pieces)
        encoding = self._tk.encode(joined, add_special_tokens=False)
        spans, pos = [], 0
        for text, is_message in pieces:
            if is_message and text:
                spans.append((pos, pos + len(text)))
            pos += len(text)
        if not any(self._types[i] == TOKEN_CONTROL and start < end_span and start_span < end
                   for i, (start, end) in zip(encoding.ids, encoding.offsets)
                   for start_span, end_span in spans):
            return self._bos + encoding.ids
        if self._control is None:  # ~0.5 s to compile for Gemma's 6,000 control tokens
            self._control = _control_tokens(self._bytes, self._types)
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
        return [self._bos + e.ids + self._eos
                for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD. For streaming use
        :meth:`token_bytes` and decode only complete UTF-8 sequences."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes ``token_id`` stands for: byte-level BPE, the GPT-2 byte map reversed;
        SentencePiece, the piece with ``▁`` as a space and a ``<0xNN>`` token as byte NN; control
        and user-defined tokens, their UTF-8 text. One token may hold part of a multi-byte
        character.

        Raises:
            IndexError: ``token_id`` outside ``0 .. vocab_size - 1``.
        """
        if token_id < 0:
            raise IndexError(f"token id {token_id} is negative")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` ...) and
        a GGUF's unknown token (``<unk>``, type 2): the tokens matched whole in text and left out
        of a stream by ``skip_special_tokens``.

        Raises:
            IndexError: ``token_id`` outside ``0 .. vocab_size - 1``.
        """
        if token_id < 0:
            raise IndexError(f"token id {token_id} is negative")
        return self._types[token_id] == TOKEN_CONTROL

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of ``token_id``: byte-alphabet spelling for byte-level BPE (e.g.
        ``ĠParis``), the piece for SentencePiece (e.g. ``▁Paris``, ``<0x0A>``)."""
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
    unk_token_id = None
    pad_token_id = None
    chat_template = None
    add_bos_token = False
    add_eos_token = False

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
