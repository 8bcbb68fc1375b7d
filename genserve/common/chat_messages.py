"""Chat messages as OpenAI's chat API sends them, checked: every error names the field.

Shared by the bridge (which checks a REST body before calling the engine) and the engine service
(which checks what a gRPC client sends). Rendering them into a prompt is service/chat.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant")
"""Roles a message may have: OpenAI's chat roles without tool calls ("developer" is OpenAI's newer
name for "system" and is rendered as "system", as vLLM does for templates that predate it)."""

TOOL_ROLE = "tool"
"""The role of a tool result, accepted where the model's template writes tool turns itself
(`parse_messages` with ``tools=True``)."""

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
class ToolCall:
    """An earlier call of a function, in an assistant message.

    Attributes:
        id: the call's id ("" when the client sent none).
        name: the function's name.
        arguments: the arguments as JSON text (as OpenAI sends them; an object sent as an object
            is written as compact JSON).
    """

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a conversation.

    Attributes:
        role: one of `ROLES`, or `TOOL_ROLE` (with ``tools=True``).
        content: its text (OpenAI content parts of type "text" are joined with no separator);
            None only for an assistant message that calls tools and says nothing.
        tool_calls: an assistant message's calls (with ``tools=True``).
        tool_call_id: a tool message's call id.
    """

    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


def parse_messages(raw: Any, field: str = "messages", *, tools: bool = False) -> tuple[ChatMessage, ...]:
    """Check an OpenAI-style ``messages`` value and return it as `ChatMessage`s.

    Accepted: a non-empty list (at most `MAX_MESSAGES`) of objects with ``role`` (a string in
    `ROLES`) and ``content`` (a string, or a list of ``{"type": "text", "text": str}`` parts).
    A ``name`` string is allowed and ignored; other keys are rejected. With `tools` (a template
    that writes tool turns itself), also: an assistant message's ``tool_calls`` (a list of
    ``{"id", "type": "function", "function": {"name", "arguments"}}``; its ``content`` may then
    be null or absent) and ``role: "tool"`` messages (``tool_call_id``, ``content``).

    Raises:
        ChatError: naming the first field at fault, e.g. ``messages[0].role``,
            ``messages[2].tool_calls[0].function.name``.
    """
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ChatError(field, "must be a list of messages")
    if not raw:
        raise ChatError(field, "must hold at least one message")
    if len(raw) > MAX_MESSAGES:
        raise ChatError(field, f"holds {len(raw)} messages, at most {MAX_MESSAGES} are allowed")
    return tuple(_parse_message(m, f"{field}[{i}]", tools) for i, m in enumerate(raw))


def _parse_message(m: Any, at: str, tools: bool) -> ChatMessage:
    """One message of `parse_messages`, at field `at`. Raises ChatError."""
    if not isinstance(m, Mapping):
        raise ChatError(at, "must be an object with role and content")
    role = m.get("role")
    if role == TOOL_ROLE and not tools:
        raise ChatError(f"{at}.role", "'tool' messages need a chat template that defines tool calls")
    allowed = ["role", "content", "name"]
    if tools and role == "assistant":
        allowed.append("tool_calls")
    if tools and role == TOOL_ROLE:
        allowed.append("tool_call_id")
    extra = set(m) - set(allowed)
    if extra:
        raise ChatError(f"{at}.{sorted(extra)[0]}", f"is not supported (only {', '.join(allowed)})")
    roles = ROLES + (TOOL_ROLE,) if tools else ROLES
    if not isinstance(role, str) or role not in roles:
        raise ChatError(f"{at}.role", f"must be one of {', '.join(roles)}, got {role!r}")
    if "name" in m and not isinstance(m["name"], str):
        raise ChatError(f"{at}.name", "must be a string")
    calls = _tool_calls(m.get("tool_calls"), f"{at}.tool_calls") if "tool_calls" in m else ()
    if calls and m.get("content") is None:
        return ChatMessage(role, None, calls)
    content = _content_text(m.get("content"), f"{at}.content")
    if role == TOOL_ROLE:
        if not isinstance(m.get("tool_call_id"), str):
            raise ChatError(f"{at}.tool_call_id", "must be the id of the call this answers (a string)")
        return ChatMessage(role, content, tool_call_id=m["tool_call_id"])
    return ChatMessage("system" if role == "developer" else role, content, calls)


def _tool_calls(raw: Any, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (see `parse_messages`). Raises ChatError naming the
    field (``messages[2].tool_calls[0].function.arguments``)."""
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise ChatError(field, "must be a list of tool calls")
    out = []
    for j, call in enumerate(raw):
        at = f"{field}[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise ChatError(at, 'must be {"type": "function", "id", "function": {"name", "arguments"}}')
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatError(f"{at}.id", "must be a string")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"{at}.function.name", "must be a non-empty string")
        args = fn.get("arguments")
        if args is None or args == "":
            args = "{}"
        elif isinstance(args, Mapping):
            args = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
        elif not isinstance(args, str):
            raise ChatError(f"{at}.function.arguments", "must be JSON text (a string)")
        out.append(ToolCall(call_id or "", fn["name"], args))
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
