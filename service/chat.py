"""Chat messages → prompt text, with the model's own chat template.

An instruct model was trained on conversations laid out in one exact format (SmolLM2:
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message). The model file carries that format as a
Jinja template (GGUF ``tokenizer.chat_template``; ``chat_template`` in a Hugging Face
``tokenizer_config.json``). A chat request is rendered with it, the generation prompt appended
(``<|im_start|>assistant\\n``), and the text is tokenized like any prompt, control tokens matched
whole. The rendering follows transformers' ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``): an immutable sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter, and the
``raise_exception`` and ``strftime_now`` globals, so a template behaves here as it does there.

Messages are checked first; every error names the field (``messages[2].role``) and becomes a 400.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

ROLES = ("system", "developer", "user", "assistant")
"""Roles a message may have: OpenAI's chat roles without tool calls ("developer" is OpenAI's newer
name for "system" and is rendered as "system", as vLLM does for templates that predate it)."""

MAX_MESSAGES = 1024
"""Most messages one request may carry (the prompt's token limit applies after rendering)."""


class ChatError(ValueError):
    """A chat request that cannot be rendered: bad messages or a template that fails.

    Attributes:
        field: the request field at fault, e.g. "messages[1].content" (the 400's field).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation.

    Attributes:
        role: one of `ROLES`.
        content: its text (OpenAI content parts of type "text" are joined with no separator).
    """

    role: str
    content: str


def parse_messages(raw: Any, field: str = "messages") -> tuple[ChatMessage, ...]:
    """Check an OpenAI-style ``messages`` value and return it as `ChatMessage`s.

    Accepted: a non-empty list (at most `MAX_MESSAGES`) of objects with ``role`` (a string in
    `ROLES`) and ``content`` (a string, or a list of ``{"type": "text", "text": str}`` parts).
    A ``name`` string is allowed and ignored; other keys are rejected.

    Raises:
        ChatError: naming the first field at fault, e.g. ``messages[0].role``.
    """
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ChatError(field, "must be a list of messages")
    if not raw:
        raise ChatError(field, "must hold at least one message")
    if len(raw) > MAX_MESSAGES:
        raise ChatError(field, f"holds {len(raw)} messages, at most {MAX_MESSAGES} are allowed")
    out = []
    for i, m in enumerate(raw):
        at = f"{field}[{i}]"
        if not isinstance(m, Mapping):
            raise ChatError(at, "must be an object with role and content")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ChatError(f"{at}.{sorted(extra)[0]}", "is not supported (only role, content, name)")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatError(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if "name" in m and not isinstance(m["name"], str):
            raise ChatError(f"{at}.name", "must be a string")
        out.append(ChatMessage("system" if role == "developer" else role,
                               _content_text(m.get("content"), f"{at}.content")))
    return tuple(out)


def _content_text(content: Any, field: str) -> str:
    """A message's content as one string (see `parse_messages`). Raises ChatError."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ChatError(f"{field}[{j}]", 'must be {"type": "text", "text": <string>} '
                                "(other content types are not supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(field, "must be a string or a non-empty list of text parts")


def _raise_exception(message: str) -> NoReturn:
    """The ``raise_exception`` global templates call to refuse a conversation."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter as transformers defines it (no HTML escaping, unlike Jinja's)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """The ``strftime_now`` global (templates that print today's date)."""
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text.
        special_tokens: variables the template may read, e.g. {"bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>"} (transformers passes the tokenizer's special tokens).
    Raises:
        ChatError: field "chat_template" when the source does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError("chat_template", f"does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener.

        Raises:
            ChatError: field "messages" when the template refuses the conversation (its
                ``raise_exception``) or fails while rendering it.
        """
        data = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(messages=data, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError("messages", f"the model's chat template refused them: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatError("messages", f"the model's chat template failed on them: "
                                        f"{type(e).__name__}: {e}") from e


def template_from_gguf(reader: Any) -> ChatTemplate | None:
    """The chat template a GGUF file carries (``tokenizer.chat_template``), or None.

    Args:
        reader: a ``gguf.GGUFReader`` of the model file.
    The special-token variables come from ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``.
    Raises:
        ChatError: the template does not compile.
    """
    def string(key: str) -> str | None:
        f = reader.fields.get(key)
        return None if f is None else bytes(f.parts[f.data[0]]).decode("utf-8")

    source = string("tokenizer.chat_template")
    if source is None:
        return None
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    special = {}
    for name in ("bos", "eos", "unk", "pad"):
        key = {"unk": "unknown", "pad": "padding"}.get(name, name)
        f = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None and tokens is not None:
            token_id = int(f.parts[f.data[0]][0])
            if 0 <= token_id < len(tokens.data):
                special[f"{name}_token"] = bytes(tokens.parts[tokens.data[token_id]]).decode("utf-8")
    return ChatTemplate(source, special)


def template_from_hf_dir(directory: str | Any) -> ChatTemplate | None:
    """The chat template of a Hugging Face model directory, or None.

    Read from ``chat_template.jinja`` when present, else the ``chat_template`` string of
    ``tokenizer_config.json`` (a list of named templates: the one named "default"); special-token
    variables from the same ``tokenizer_config.json`` (strings or ``{"content": ...}`` objects).
    Raises:
        ChatError: the template does not compile.
        OSError / json.JSONDecodeError: an unreadable tokenizer_config.json.
    """
    import pathlib
    d = pathlib.Path(directory)
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text("utf-8")) if config_path.exists() else {}
    jinja_file = d / "chat_template.jinja"
    source = jinja_file.read_text("utf-8") if jinja_file.exists() else config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    special = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    return ChatTemplate(source, special)
