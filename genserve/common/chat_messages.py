"""Chat messages as OpenAI's chat API sends them, checked: every error names the field.

Shared by the bridge (which checks a REST body before calling the engine) and the engine service
(which checks what a gRPC client sends). Rendering them into a prompt is service/chat.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
