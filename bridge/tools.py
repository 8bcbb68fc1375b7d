"""OpenAI function calling: the tool-call format of the served model (`ToolFormat`), a grammar
for the calls in it, and the parser that turns the answer back into `tool_calls`.

Which format: the engine reports it (``InfoResponse.tool_call_parser``, chosen at load by
`genserve.common.tool_parsers.choose_tool_call_parser`: the family's, or ``--tool-call-parser``).
When the model's chat template defines tool calls (it reads ``tools``: Qwen2.5/3, Llama 3.1,
Mistral), the request's tools, earlier assistant ``tool_calls`` and ``role: "tool"`` messages go
to the engine as they are (`chat_messages_proto` in bridge/protocol.py) and the template writes
them, as transformers' ``apply_chat_template(..., tools=...)`` does; the model answers in its
template's format, named as vLLM's ``--tool-call-parser`` names them:

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, calls joined by
  a newline (Qwen),
- ``llama3_json``: ``{"name": ..., "parameters": {...}}``, calls joined by ``; `` (Llama 3.1; an
  answer may start with ``<|python_tag|>``),
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (call ids: nine letters
  and digits, which Mistral's template requires of the ids it is given back).

When the template knows no tools (SmolLM2's), the bridge writes the tools into the conversation
itself, in the widely used Hermes format (the ``generic`` format): a system message lists the
functions as JSON and asks for calls as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``; an earlier assistant message's ``tool_calls`` are written back in that form, and a
``role: "tool"`` message becomes a user message ``<tool_response>{"tool_call_id": ...,
"content": ...}</tool_response>``.

Decoding is constrained in every format (a Lark grammar with the functions' `parameters` schemas
embedded, engine/structured; `ToolSetup.grammar`): with ``tool_choice`` "required" or a named
function the answer is one call (or several, with ``parallel_tool_calls``) whose arguments
validate against the function's schema (closed: no keys beyond those the schema lists,
genserve/common/json_schemas.py); with "auto" it is either calls or text that does not start the
way calls do (``<``, ``{`` or ``[``). A function without ``parameters`` takes none (its arguments
are ``{}``); arguments are compact JSON, as ``response_format`` answers are. Each ``parameters``
schema is embedded with its local references rebased (`genserve.common.json_schemas.embed_schema`),
so pydantic's ``$defs`` / ``$ref`` (nested models) resolve inside the call grammar. A grammar never
lets a control token out (engine/structured/vocab.py), so a format's markers that are control
tokens in the model's vocabulary (Mistral's ``[TOOL_CALLS]``) are spelled as text under it; the
parsers read either.

With ``tool_choice`` "none" there is no tool machinery at all (`tool_setup` gives None): no tools
given to the template, no tool prompt, no grammar, no parsing; the answer is text, streamed as it
is made. Earlier tool calls and results in the conversation are still written (by the template,
or as text with `render_messages`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from bridge.constraints import ConstraintFieldError
from genserve.common.json_schemas import JSON_OUTPUT_OPTIONS, close_objects, embed_schema
from genserve.common.chat_messages import ChatError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_PROMPT = ("You can call these functions. To call one, answer only with "
               f"{OPEN}{{\"name\": <function name>, \"arguments\": <arguments object>}}{CLOSE} "
               "(one block per call). Functions:\n")
# The arguments of a function that declares no `parameters`: none (OpenAI's reading).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
PYTHON_TAG = "<|python_tag|>"          # Llama 3.1: may open a call (a control token)
MISTRAL_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one tool-call format writes an answer of calls:
    ``begin + open + call + close + (sep + open + call + close)* + end``, each call a JSON object
    ``{"name": ..., <args_key>: {...}}``.

    Attributes:
        name: vLLM's ``--tool-call-parser`` name, or "generic" (the bridge's own prompt).
        begin, end: around all the calls (Mistral's ``[TOOL_CALLS][`` and ``]``).
        open, close: around each call.
        sep: between two calls.
        args_key: the key of the arguments object ("arguments"; Llama's "parameters").
        starts: the first character of an answer that is calls; an "auto" text answer may not
            start with it, and a stream holds back an answer that does until it ends.
        native: the model's template writes the tools (else the bridge's generic prompt does).
    """

    name: str
    begin: str
    end: str
    open: str
    close: str
    sep: str
    args_key: str
    starts: str
    native: bool = True

    def may_be_calls(self, text: str) -> bool:
        """Whether an answer so far may be calls (held back from a stream until it ends); for
        Llama, also while it may be ``<|python_tag|>`` (a control token, in the text only when a
        stream keeps special tokens)."""
        head = text.lstrip()
        if self.name == "llama3_json" and head.startswith("<"):
            return head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)
        return head.startswith(self.starts)

    def call_id(self) -> str:
        """A new call's id: ``call_<24 hex>`` (OpenAI's shape), or for Mistral nine letters and
        digits (its template refuses other ids when the calls come back)."""
        if self.name == "mistral":
            return "".join(secrets.choice(MISTRAL_ID_CHARS) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> list[dict] | None:
        """The OpenAI `tool_calls` of an answer made only of calls in this format (arguments as
        compact JSON text, as the grammar has the model write them), or None when it is text (or
        not well-formed calls)."""
        calls = self._objects(text.strip())
        if not calls:
            return None
        out = []
        for call in calls:
            args = call.get(self.args_key, call.get("arguments")) if isinstance(call, dict) else None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
                return None
            out.append({"id": self.call_id(), "type": "function",
                        "function": {"name": call["name"],
                                     "arguments": json.dumps(args, separators=(",", ":"), ensure_ascii=False)}})
        return out

    def _objects(self, text: str) -> list | None:
        """The JSON values of the calls in `text` (stripped), or None when it is not calls."""
        if self.name == "mistral":
            if not text.startswith("[TOOL_CALLS]"):
                return None
            return _json_list(text[len("[TOOL_CALLS]"):].lstrip())
        if self.name == "llama3_json":
            text = text.removeprefix(PYTHON_TAG).lstrip()
            return _json_sequence(text) if text.startswith("{") else None
        if not text.startswith(OPEN):
            return None
        out = []
        rest = text
        while rest:
            if not rest.startswith(OPEN) or CLOSE not in rest:
                return None
            body, _, rest = rest[len(OPEN):].partition(CLOSE)
            rest = rest.lstrip()
            try:
                out.append(json.loads(body))
            except json.JSONDecodeError:
                return None
        return out

    def write(self, calls: list[dict]) -> str:
        """`calls` ({"name", "arguments"} each) as this format writes them (the answers the
        grammar admits; the tests' round trip)."""
        return self.begin + self.sep.join(
            self.open + json.dumps({"name": c["name"], self.args_key: c["arguments"]},
                                   separators=(",", ":"), ensure_ascii=False) + self.close
            for c in calls) + self.end


GENERIC = ToolFormat("generic", "", "", OPEN, CLOSE, "", "arguments", "<", native=False)
TOOL_FORMATS = MappingProxyType({f.name: f for f in (
    GENERIC,
    ToolFormat("hermes", "", "", OPEN + "\n", "\n" + CLOSE, "\n", "arguments", "<"),
    ToolFormat("llama3_json", "", "", "", "", "; ", "parameters", "{"),
    ToolFormat("mistral", "[TOOL_CALLS][", "]", "", "", ", ", "arguments", "["),
)})
"""Every format by name (read-only): the generic prompt's and `TOOL_CALL_PARSERS`'."""


def tool_format(parser: str) -> ToolFormat:
    """The format of an engine's ``InfoResponse.tool_call_parser``: "" is the generic prompt.

    Raises:
        ValueError: a name the bridge does not know (an engine newer than the bridge).
    """
    if not parser:
        return GENERIC
    if parser not in TOOL_FORMATS or parser == "generic":
        raise ValueError(f"unknown tool-call parser {parser!r}")
    return TOOL_FORMATS[parser]


def _json_sequence(text: str) -> list | None:
    """JSON values one after another, separated by whitespace or ``;`` (Llama's parallel calls),
    or None when `text` is not that."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        out.append(value)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return out


def _json_list(text: str) -> list | None:
    """The JSON array `text` is (nothing but whitespace after it), or None."""
    try:
        value, pos = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and not text[pos:].strip() else None


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """The tools of a chat request and how they may be called.

    Attributes:
        functions: the `function` objects (name, description, parameters).
        choice: "auto", "required", or the name of the one function to call.
        parallel: several calls allowed in one answer.
        tools: the request's `tools` as sent (what a template that defines tools is given).
        format: the served model's tool-call format (`GENERIC` for a template without tools).
    """

    functions: tuple[dict, ...]
    choice: str
    parallel: bool
    tools: tuple[dict, ...] = ()
    format: ToolFormat = GENERIC

    def grammar(self) -> str:
        """The Lark grammar of the allowed answers in `format`: calls (one, or several with
        `parallel`) of the callable functions, each's arguments following its `parameters`
        (closed, compact, its references rebased to where the schema stands in the call's); with
        "auto", text too (text that does not start as calls do)."""
        fmt = self.format
        names = [self.choice] if self.choice not in ("auto", "required") else [f["name"] for f in self.functions]
        callable_ = [f for f in self.functions if f["name"] in names]
        # Where each function's arguments schema stands in the grammar's JSON schema.
        key = fmt.args_key
        base = f"/properties/{key}" if len(callable_) == 1 else "/anyOf/{}/properties/" + key
        shapes = [{"type": "object", "properties": {
            "name": {"const": f["name"]},
            key: embed_schema(close_objects(arguments_schema(f)), base.format(k))},
            "required": ["name", key], "additionalProperties": False}
            for k, f in enumerate(callable_)]
        root = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        schema = json.dumps({"x-guidance": JSON_OUTPUT_OPTIONS, **root}, separators=(",", ":"))

        def seq(*parts: str) -> str:
            return " ".join(p for p in parts if p)

        def lit(text: str) -> str:
            return json.dumps(text) if text else ""

        if not self.parallel:
            calls = "call"
        elif fmt.sep:
            calls = f"call ({lit(fmt.sep)} call)*"
        else:
            calls = "call+"
        text = "/[^" + re.escape(fmt.starts) + "](.|\\n)*/"
        start = "start: calls | TEXT" if self.choice == "auto" else "start: calls"
        return (f"{start}\ncalls: {seq(lit(fmt.begin), calls, lit(fmt.end))}\n"
                f"call: {seq(lit(fmt.open), 'args', lit(fmt.close))}\nargs: %json {schema}\n"
                f"TEXT: {text}\n")

    def system_text(self) -> str:
        """The generic tool prompt's system text."""
        return TOOL_PROMPT + "\n".join(json.dumps({"type": "function", "function": f}) for f in self.functions)


def arguments_schema(function: dict) -> Any:
    """The schema a function's arguments follow: its `parameters`, or, when it has none (absent
    or null), no arguments at all (`NO_PARAMETERS`: the arguments are ``{}``)."""
    parameters = function.get("parameters")
    if parameters is None:
        return NO_PARAMETERS
    return parameters or {"type": "object"}          # {}: any object (arguments are an object)


def tool_setup(tools: list | None, tool_choice: Any, parallel: bool | None,
               fmt: ToolFormat = GENERIC) -> ToolSetup | None:
    """The request's tools when a call may be made, in the served model's format `fmt`, or None:
    no tools, or `tool_choice` "none" (the tools are still checked; the answer is then text, with
    no tool prompt, grammar or parsing).

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
    return ToolSetup(tuple(functions), choice, parallel is not False, tuple(tools or ()), fmt)


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


def parse_tool_calls(text: str, fmt: ToolFormat = GENERIC) -> list[dict] | None:
    """The OpenAI `tool_calls` of an answer made only of calls in `fmt` (`ToolFormat.parse`), or
    None when it is text."""
    return fmt.parse(text)
