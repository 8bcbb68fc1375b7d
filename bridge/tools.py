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
with "auto" it is either text that does not start with ``<`` or calls. A function without
``parameters`` takes none (its arguments are ``{}``); arguments are compact JSON, as
``response_format`` answers are. Each ``parameters`` schema is embedded with its local
references rebased (`genserve.common.json_schemas.embed_schema`), so pydantic's ``$defs`` /
``$ref`` (nested models) resolve inside the call grammar.

With ``tool_choice`` "none" there is no tool machinery at all (`tool_setup` gives None): no tool
prompt, no grammar, no parsing; the answer is text, streamed as it is made. Earlier tool calls
and results in the conversation are still written as text (`render_messages`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from bridge.constraints import ConstraintFieldError
from genserve.common.json_schemas import JSON_OUTPUT_OPTIONS, close_objects, embed_schema
from genserve.common.chat_messages import ChatError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
TOOL_PROMPT = ("You can call these functions. To call one, answer only with "
               f"{OPEN}{{\"name\": <function name>, \"arguments\": <arguments object>}}{CLOSE} "
               "(one block per call). Functions:\n")
# The arguments of a function that declares no `parameters`: none (OpenAI's reading).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """The tools of a chat request and how they may be called.

    Attributes:
        functions: the `function` objects (name, description, parameters).
        choice: "auto", "required", or the name of the one function to call.
        parallel: several calls allowed in one answer.
    """

    functions: tuple[dict, ...]
    choice: str
    parallel: bool

    def grammar(self) -> str:
        """The Lark grammar of the allowed answers: calls (one, or several with `parallel`) of
        the callable functions, each's arguments following its `parameters` (closed, compact, its
        references rebased to where the schema stands in the call's); with "auto", text too."""
        names = [self.choice] if self.choice not in ("auto", "required") else [f["name"] for f in self.functions]
        callable_ = [f for f in self.functions if f["name"] in names]
        # Where each function's arguments schema stands in the grammar's JSON schema.
        base = "/properties/arguments" if len(callable_) == 1 else "/anyOf/{}/properties/arguments"
        shapes = [{"type": "object", "properties": {
            "name": {"const": f["name"]},
            "arguments": embed_schema(close_objects(arguments_schema(f)), base.format(k))},
            "required": ["name", "arguments"], "additionalProperties": False}
            for k, f in enumerate(callable_)]
        root = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        schema = json.dumps({"x-guidance": JSON_OUTPUT_OPTIONS, **root}, separators=(",", ":"))
        calls = "call+" if self.parallel else "call"
        start = f"start: {calls} | TEXT" if self.choice == "auto" else f"start: {calls}"
        return (f"{start}\ncall: \"{OPEN}\" args \"{CLOSE}\"\nargs: %json {schema}\n"
                "TEXT: /[^<](.|\\n)*/\n")

    def system_text(self) -> str:
        """The tool prompt's system text."""
        return TOOL_PROMPT + "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions)


def arguments_schema(function: dict) -> Any:
    """The schema a function's arguments follow: its `parameters`, or, when it has none (absent
    or null), no arguments at all (`NO_PARAMETERS`: the arguments are ``{}``)."""
    parameters = function.get("parameters")
    if parameters is None:
        return NO_PARAMETERS
    return parameters or {"type": "object"}          # {}: any object (arguments are an object)


def tool_setup(tools: list | None, tool_choice: Any, parallel: bool | None) -> ToolSetup | None:
    """The request's tools when a call may be made, or None: no tools, or `tool_choice` "none"
    (the tools are still checked; the answer is then text, with no tool prompt, grammar or
    parsing).

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
    if choice == "none":
        return None
    return ToolSetup(tuple(functions), choice, parallel is not False)


def render_messages(messages: Any) -> Any:
    """OpenAI messages with tool calls and tool results written as text (the generic format), one
    message for one, so that a later error about ``messages[k]`` still names the client's message
    k: an assistant message's ``tool_calls`` become call blocks after its text, a ``role: "tool"``
    message a user message holding a ``<tool_response>``. Other messages keep their fields but
    those that are null (absent, as everywhere in a body) and an empty ``tool_calls``
    (`genserve.common.chat_messages.parse_messages` checks them); a value that is not a list is
    returned as is, for the same reason.

    Raises:
        ChatError: naming the field of a malformed tool call or tool message
            (``messages[2].tool_calls[0].function.name``).
    """
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise ChatError(f"{at}.tool_calls", "must be a list of tool calls")
            blocks = "".join(f"{OPEN}{json.dumps(_call(c, f'{at}.tool_calls[{j}]'))}{CLOSE}"
                             for j, c in enumerate(calls))
            named = {"name": m["name"]} if "name" in m else {}
            out.append({"role": "assistant", **named, "content": _text(m.get("content"), f"{at}.content") + blocks})
        elif isinstance(m, dict) and m.get("role") == "tool":
            extra = sorted(set(m) - {"role", "content", "tool_call_id", "name"})
            if extra:
                raise ChatError(f"{at}.{extra[0]}", "is not supported (only role, content, tool_call_id, name)")
            if not isinstance(m.get("tool_call_id"), str):
                raise ChatError(f"{at}.tool_call_id", "must be the id of the call this answers (a string)")
            body = json.dumps({"tool_call_id": m["tool_call_id"], "content": _text(m.get("content"), f"{at}.content")})
            out.append({"role": "user", "content": f"<tool_response>{body}</tool_response>"})
        elif isinstance(m, dict):
            # null means absent (the openai SDK's `message.model_dump()` sends refusal, audio,
            # annotations, function_call and tool_calls as null; an empty tool_calls is no call)
            out.append({k: v for k, v in m.items() if v is not None and not (k == "tool_calls" and v == [])})
        else:
            out.append(m)
    return out


def _text(content: Any, field: str) -> str:
    """A tool turn's content as text: null (none), a string, or a list of text parts joined.
    Raises ChatError naming `field`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ChatError(field, "must be a string or a list of {\"type\": \"text\", \"text\": <string>} parts")


def _call(call: Any, field: str) -> dict:
    """An earlier assistant tool call as the block's JSON (name, arguments). Raises ChatError
    naming `field`: not a function call with a name, or arguments that are not a string or an
    object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ChatError(field, "must be {\"type\": \"function\", \"id\", \"function\": {\"name\", \"arguments\"}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatError(f"{field}.function.name", "must be a non-empty string")
    raw = fn.get("arguments")
    if raw is None or raw == "":
        return {"name": fn["name"], "arguments": {}}
    if isinstance(raw, dict):
        return {"name": fn["name"], "arguments": raw}
    if not isinstance(raw, str):
        raise ChatError(f"{field}.function.arguments", "must be JSON text (a string)")
    try:
        return {"name": fn["name"], "arguments": json.loads(raw)}
    except json.JSONDecodeError:
        return {"name": fn["name"], "arguments": raw}       # written back as the model wrote it


def parse_tool_calls(text: str) -> list[dict] | None:
    """The OpenAI `tool_calls` of an answer made only of call blocks (ids ``call_<hex>``,
    arguments as compact JSON text, as the grammar has the model write them), or None when it is
    text."""
    if not text.lstrip().startswith(OPEN):
        return None
    calls = []
    for body in CALL_RE.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call["arguments"], separators=(",", ":"),
                                                           ensure_ascii=False)}})
    return calls or None
