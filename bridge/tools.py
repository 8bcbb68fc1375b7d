"""OpenAI function calling on a model whose chat template knows no tools: a generic tool prompt,
a grammar for the calls, and the parser that turns the answer back into `tool_calls`.

The served model's template (SmolLM2's) has no tool syntax, so the bridge writes the tools into
the conversation itself, in the widely used Hermes format: a system message lists the functions
as JSON and asks for calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; an
earlier assistant message's ``tool_calls`` are written back in that form, and a ``role: "tool"``
message becomes a user message ``<tool_response>{"tool_call_id": ..., "content": ...}
</tool_response>``. Decoding is constrained (a Lark grammar with the functions' `parameters`
schemas embedded, engine/structured): with ``tool_choice`` "required" or a named function the
answer is one call (or several, with ``parallel_tool_calls``) whose arguments validate against
the function's schema (closed: no keys beyond those the schema lists, genserve/common/json_schemas.py);
with "auto" it is either text that does not start with ``<`` or calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from bridge.constraints import ConstraintFieldError
from genserve.common.json_schemas import close_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
TOOL_PROMPT = ("You can call these functions. To call one, answer only with "
               f"{OPEN}{{\"name\": <function name>, \"arguments\": <arguments object>}}{CLOSE} "
               "(one block per call). Functions:\n")


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """The tools of a chat request and how they may be called.

    Attributes:
        functions: the `function` objects (name, description, parameters).
        choice: "none", "auto", "required", or the name of the one function to call.
        parallel: several calls allowed in one answer.
    """

    functions: tuple[dict, ...]
    choice: str
    parallel: bool

    def grammar(self) -> str | None:
        """The Lark grammar of the allowed answers (None for "none": free text)."""
        if self.choice == "none":
            return None
        names = [self.choice] if self.choice not in ("auto", "required") else [f["name"] for f in self.functions]
        shapes = [{"type": "object", "properties": {
            "name": {"const": f["name"]},
            "arguments": close_objects(f.get("parameters") or {"type": "object"})},
            "required": ["name", "arguments"], "additionalProperties": False}
            for f in self.functions if f["name"] in names]
        schema = json.dumps(shapes[0] if len(shapes) == 1 else {"anyOf": shapes}, separators=(",", ":"))
        calls = "call+" if self.parallel else "call"
        start = f"start: {calls} | TEXT" if self.choice == "auto" else f"start: {calls}"
        return (f"{start}\ncall: \"{OPEN}\" args \"{CLOSE}\"\nargs: %json {schema}\n"
                "TEXT: /[^<](.|\\n)*/\n")

    def system_text(self) -> str:
        """The tool prompt's system text."""
        return TOOL_PROMPT + "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions)


def tool_setup(tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolSetup | None:
    """The request's tools, or None when it has none (or `tool_choice` "none" with no tools).

    Raises:
        ConstraintFieldError: naming the field: a tool that is not a function with a name, a
            `tool_choice` that is not none/auto/required/a named function of `tools`.
    """
    functions = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintFieldError(f"tools[{i}]", "must be {\"type\": \"function\", \"function\": {\"name\", ...}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ConstraintFieldError(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        functions.append(fn)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in [f["name"] for f in functions]:
            raise ConstraintFieldError("tool_choice", "must name a function of tools")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise ConstraintFieldError("tool_choice", "must be none, auto, required or a named function")
    if not functions:
        if choice == "required":
            raise ConstraintFieldError("tool_choice", "'required' needs tools")
        return None
    return ToolSetup(tuple(functions), choice, parallel is not False)


def render_messages(messages: list, setup: ToolSetup | None) -> list:
    """OpenAI messages with tool calls and tool results written as text (the generic format),
    and the tool prompt first when there are tools. Other messages are left as they are (their
    fields are checked later)."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "".join(f"{OPEN}{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}{CLOSE}"
                            for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        elif isinstance(m, dict) and m.get("role") == "tool":
            body = json.dumps({"tool_call_id": m.get("tool_call_id"), "content": m.get("content")})
            out.append({"role": "user", "content": f"<tool_response>{body}</tool_response>"})
        else:
            out.append(m)
    if setup is not None and setup.choice != "none":
        out.insert(0, {"role": "system", "content": setup.system_text()})
    return out


def _args(call: dict) -> Any:
    raw = call["function"].get("arguments") or "{}"
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


def parse_tool_calls(text: str) -> list[dict] | None:
    """The OpenAI `tool_calls` of an answer made only of call blocks (ids ``call_<hex>``,
    arguments as JSON text), or None when it is text."""
    if not text.lstrip().startswith(OPEN):
        return None
    calls = []
    for body in CALL_RE.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
    return calls or None
