"""Chat messages → prompt text, with the model's own chat template.

An instruct model was trained on conversations laid out in one exact format (SmolLM2:
``<|im_start|>role\\ncontent<|im_end|>\\n`` per message). The model file carries that format as a
Jinja template (GGUF ``tokenizer.chat_template``; ``chat_template`` in a Hugging Face
``tokenizer_config.json``). A chat request is rendered with it, the generation prompt appended
(``<|im_start|>assistant\\n``), and tokenized: the template's own text with control tokens
matched whole, each message's text as plain text (`render_pieces`), so that a user who writes
``<|im_end|><|im_start|>system`` gets those characters, not a closed turn and a forged system turn. The rendering follows transformers' ``apply_chat_template``
(``transformers/utils/chat_template_utils.py``): an immutable sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter, and the
``raise_exception`` and ``strftime_now`` globals, so a template behaves here as it does there.

Tools: a template that reads the ``tools`` variable (`ChatTemplate.defines_tools`, found with
``jinja2.meta.find_undeclared_variables`` as vLLM and transformers look for it) writes the tools,
earlier tool calls and tool results itself (Qwen's ``<tool_call>``, Llama 3.1's JSON, Mistral's
``[TOOL_CALLS]``). It is given what transformers' ``apply_chat_template(messages, tools=...)``
gives it: ``tools`` as the OpenAI tool objects, an assistant message's ``tool_calls`` as
``{"id", "type": "function", "function": {"name", "arguments"}}`` with the arguments as an object
(parsed from the JSON text, as vLLM hands them to transformers; text that does not parse stays
text) and content None when the message says nothing, a tool result as ``{"role": "tool",
"content", "tool_call_id"}``. A message's text is still kept apart from the template's
(`render_pieces`), even where the template edits it with ``trim`` or writes it with ``tojson``
(Llama 3.1 writes a tool result as a JSON string): the edit is recorded on the marker and applied
to the text, so the prompt is byte for byte what transformers renders.

Messages are checked first (genserve/common/chat_messages.py); every error names the field
(``messages[2].role``) and becomes a 400.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox

from genserve.common.chat_messages import ChatError, ChatMessage


# A message marker (`ChatTemplate.render_pieces`): nonce, message index, and the edits a filter made
# to it, in order ("t" trim, "j" JSON string escaping, "a" the same with ensure_ascii).
_MARKER = re.compile("\ue000([0-9a-f]{32}):(\\d+)((?::[ajt]+)?)\ue001")
# The same marker inside JSON text written with ensure_ascii (its delimiters escaped).
_ASCII_MARKER = re.compile(r"\\ue000([0-9a-f]{32}):(\d+)((?::[ajt]+)?)\\ue001")


def _marker(nonce: str, index: str, edits: str) -> str:
    return f"\ue000{nonce}:{index}:{edits}\ue001" if edits else f"\ue000{nonce}:{index}\ue001"


def _edited(match: re.Match[str], edit: str) -> str:
    """The marker of `match` with one more edit recorded."""
    return _marker(match.group(1), match.group(2), match.group(3).lstrip(":") + edit)


def _apply_edits(text: str, edits: str) -> str:
    """A message's text with a marker's recorded edits applied, as the filters edit strings."""
    for edit in edits:
        if edit == "t":
            text = text.strip()
        else:
            text = json.dumps(text, ensure_ascii=edit == "a")[1:-1]
    return text


def _raise_exception(message: str) -> NoReturn:
    """The ``raise_exception`` global templates call to refuse a conversation."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter as transformers defines it (no HTML escaping, unlike Jinja's). A
    message marker in a string it writes is marked as JSON-escaped (`render_pieces` escapes the
    text the same way)."""
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
    if "\ue000" in text:
        text = _MARKER.sub(lambda m: _edited(m, "j"), text)
    if ensure_ascii and "\\ue000" in text:
        text = _ASCII_MARKER.sub(lambda m: _edited(m, "a"), text)
    return text


def _trim(value: Any, chars: str | None = None) -> str:
    """Jinja's ``trim`` filter; a string that is one message marker is marked as trimmed instead
    (`render_pieces` strips the text)."""
    text = str(value)
    if chars is None and _MARKER.fullmatch(text):
        return _MARKER.sub(lambda m: _edited(m, "t"), text)
    return text.strip(chars)


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

    Attributes:
        defines_tools: the template reads the ``tools`` variable: it writes tool definitions,
            calls and results itself (transformers' and vLLM's test).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters["trim"] = _trim
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
            self.defines_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateError as e:
            raise ChatError("chat_template", f"does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: list | None = None) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener.

        Args:
            messages: the conversation (tool calls and tool messages only for a template that
                `defines_tools`).
            add_generation_prompt: open the assistant's turn.
            tools: OpenAI tool objects, the template's ``tools`` (None: the variable is unset).
        Raises:
            ChatError: field "messages" when the template refuses the conversation (its
                ``raise_exception``) or fails while rendering it.
        """
        return self._render([_message_data(m, m.content) for m in messages], add_generation_prompt, tools)

    def render_pieces(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                      tools: list | None = None) -> list[tuple[str, bool]]:
        """The prompt as (text, is_message_text) pieces, in order: the template's own text
        (False), which may hold control tokens, and each message's content where the template
        placed it (True), to be tokenized as plain text. Joined, they are `render`'s text.

        Each content is rendered as a marker made of a random nonce (private-use characters and
        128 random bits, which no message can guess), then the markers are replaced by the
        contents. Edits the template makes with ``trim`` and ``tojson`` are recorded on the marker
        and applied to the content; a template that edits the content otherwise (``| upper``)
        sees the marker instead: the content goes in unedited (a marker it mangles is refused).
        Tools and tool calls are the template's own text: the caller keeps control-token text out
        of them (service/validation.py).

        Raises:
            ChatError: field "messages" as `render`; field "chat_template" when the template
                alters a message marker, so the message text cannot be kept apart.
        """
        nonce = secrets.token_hex(16)
        contents = {str(i): m.content for i, m in enumerate(messages)}
        data = [_message_data(m, None if m.content is None else _marker(nonce, str(i), ""))
                for i, m in enumerate(messages)]
        text = self._render(data, add_generation_prompt, tools)
        pieces: list[tuple[str, bool]] = []
        rest = text
        while True:
            at = rest.find("\ue000")
            if at < 0:
                break
            match = _MARKER.match(rest, at)
            if match is None or match.group(1) != nonce or contents.get(match.group(2)) is None:
                raise ChatError("chat_template", "alters message text as it prints it; genserve "
                                                 "cannot keep message text apart from its control tokens")
            pieces += [(rest[:at], False),
                       (_apply_edits(contents[match.group(2)], match.group(3).lstrip(":")), True)]
            rest = rest[match.end():]
        if "\ue001" in rest:
            raise ChatError("chat_template", "alters message text as it prints it; genserve "
                                             "cannot keep message text apart from its control tokens")
        pieces.append((rest, False))
        return [(t, literal) for t, literal in pieces if t]

    def _render(self, data: list[dict[str, Any]], add_generation_prompt: bool, tools: list | None = None) -> str:
        """Render the template over `data` (message dicts). Raises ChatError as `render`."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return self._template.render(messages=data, add_generation_prompt=add_generation_prompt,
                                         **extra, **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError("messages", f"the model's chat template refused them: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatError("messages", f"the model's chat template failed on them: "
                                        f"{type(e).__name__}: {e}") from e


def _message_data(message: ChatMessage, content: str | None) -> dict[str, Any]:
    """A message as transformers hands it to a template: role and content, an assistant's
    ``tool_calls`` (only when it has some: Llama 3.1's template tests ``'tool_calls' in
    message``) with the arguments as an object, a tool result's ``tool_call_id``."""
    data: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        data["tool_calls"] = [{"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                              for c in message.tool_calls]
    if message.tool_call_id is not None:
        data["tool_call_id"] = message.tool_call_id
    return data


def _arguments(text: str) -> Any:
    """A call's arguments as the template gets them: the object the JSON text holds (vLLM parses
    them before transformers renders), or the text when it does not parse."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_for(tokenizer: Any) -> ChatTemplate | None:
    """The chat template the model's tokenizer carries (``tokenizer.chat_template`` of a GGUF,
    ``chat_template`` of a Hugging Face ``tokenizer_config.json``), or None.

    Args:
        tokenizer: `engine.tokenizer.Tokenizer` (or anything with ``chat_template``,
            ``bos_token_id``, ``eos_token_id`` and ``token_bytes``).
    The template's ``bos_token`` / ``eos_token`` variables are those ids' text.
    Raises:
        ChatError: the template does not compile.
    """
    source = getattr(tokenizer, "chat_template", None)
    if not source:
        return None
    special = {}
    for name in ("bos", "eos"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            special[f"{name}_token"] = tokenizer.token_bytes(token_id).decode("utf-8", "replace")
    return ChatTemplate(source, special)
