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

Messages are checked first (genserve/common/chat_messages.py); every error names the field
(``messages[2].role``) and becomes a 400.
"""

from __future__ import annotations

import datetime
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from genserve.common.chat_messages import ChatError, ChatMessage


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
        return self._render([{"role": m.role, "content": m.content} for m in messages],
                            add_generation_prompt)

    def render_pieces(self, messages: Sequence[ChatMessage],
                      add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """The prompt as (text, is_message_text) pieces, in order: the template's own text
        (False), which may hold control tokens, and each message's content where the template
        placed it (True), to be tokenized as plain text.

        Each content is rendered as a marker made of a random nonce (private-use characters and
        128 random bits, which no message can guess), then the markers are replaced by the
        contents. A template that edits the content it prints (``| trim``, ``| upper``) sees the
        marker instead: the content goes in unedited (a marker it mangles is refused).

        Raises:
            ChatError: field "messages" as `render`; field "chat_template" when the template
                alters a message marker, so the message text cannot be kept apart.
        """
        nonce = secrets.token_hex(16)
        markers = {f"\ue000{nonce}:{i}\ue001": m.content for i, m in enumerate(messages)}
        text = self._render([{"role": m.role, "content": marker} for m, marker in zip(messages, markers)],
                            add_generation_prompt)
        pieces: list[tuple[str, bool]] = []
        rest = text
        while True:
            at = rest.find("\ue000")
            if at < 0:
                break
            end = rest.find("\ue001", at)
            marker = rest[at:end + 1]
            if end < 0 or marker not in markers:
                raise ChatError("chat_template", "alters message text as it prints it; genserve "
                                                 "cannot keep message text apart from its control tokens")
            pieces += [(rest[:at], False), (markers[marker], True)]
            rest = rest[end + 1:]
        if "\ue000" in rest:
            raise ChatError("chat_template", "alters message text as it prints it; genserve "
                                             "cannot keep message text apart from its control tokens")
        pieces.append((rest, False))
        return [(t, literal) for t, literal in pieces if t]

    def _render(self, data: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """Render the template over `data` (role/content dicts). Raises ChatError as `render`."""
        try:
            return self._template.render(messages=data, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError("messages", f"the model's chat template refused them: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatError("messages", f"the model's chat template failed on them: "
                                        f"{type(e).__name__}: {e}") from e


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
