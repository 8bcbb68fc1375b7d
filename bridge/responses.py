"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat path.

A Responses request is translated into the chat request it means (`ResponsesRequest.to_chat`):
``instructions`` becomes a system message; ``input`` (a string, or a list of message items and
function-call items) becomes the messages, a ``function_call`` item an assistant tool call and a
``function_call_output`` item a tool result; ``text.format`` (``json_schema`` / ``json_object``)
becomes the output constraint and flat ``function`` tools become chat tools, so both go through
the same grammar machinery (bridge/constraints.py, bridge/tools.py, engine/structured). The
answer is rebuilt from the chat builder's chunks (`ResponseBuilder`): one ``message`` output item
with one ``output_text`` part, or one ``function_call`` item per call; streamed as the
``response.*`` events OpenAI sends (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
... ``response.completed`` or ``response.incomplete``), each with its ``sequence_number``.

genserve keeps nothing after a response ends, so what needs stored state is refused with a 400
naming the field: ``store: true``, ``previous_response_id``, ``conversation``, ``background``;
so are built-in tools (web search, file search, code interpreter, ...: anything but ``function``)
and non-text input parts. A response's id is ``resp_<hex>``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr, ValidationError

from bridge.chat import ChatCompletionBuilder
from bridge.constraints import BodyConstraint, ConstraintFieldError, schema_field_text
from bridge.errors import ApiError, validation_error
from bridge.protocol import AnyObject, ChatCompletionRequest, Float, Uint32, Uint64
from bridge.serving import generate
from bridge.state import BridgeState, auth_metadata, bridge_state
from bridge.tools import ToolFormat
from genserve.common.chat_messages import ChatError
from genserve.v1 import generate_pb2 as pb

RESPONSE_ID_PREFIX = "resp_"
ROUTE = "/v1/responses"
# Input message roles and the chat role each becomes (OpenAI's "developer" is a system message).
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Text parts of an input message's content list.
TEXT_PARTS = ("input_text", "output_text", "text")
# Why stored-state fields are refused.
_STATELESS = "genserve's Responses API is stateless: nothing is stored after a response ends"
# OpenAI platform fields genserve refuses unless null, and why.
_PLATFORM_ONLY = {
    "prompt": "stored prompt templates need stored state; send the prompt as instructions and input",
    "background_options": _STATELESS,
    "context_management": "genserve does not compact or truncate conversations",
    "moderation": "genserve runs no moderation model",
    "image": "genserve serves a text model (no image generation)",
    "access_programs": "an OpenAI platform feature",
}


class ResponsesRequest(BaseModel):
    """Body of POST /v1/responses (OpenAI's fields; those needing stored state are refused by
    `refusal`). An unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    max_output_tokens: Uint32 | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Uint64 | None = None
    stream: StrictBool | None = False
    stream_options: AnyObject | None = None
    text: AnyObject | None = None
    tools: list[Any] | None = None
    tool_choice: StrictStr | AnyObject | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | AnyObject | None = None
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    service_tier: StrictStr | None = None
    truncation: StrictStr | None = None
    reasoning: AnyObject | None = None
    max_tool_calls: Uint32 | None = None
    top_logprobs: Uint32 | None = None
    # Accepted with no effect: prefix caching is automatic (per API key), blocks live while memory
    # allows, and there is no retention to choose.
    prompt_cache_options: AnyObject | None = None
    prompt_cache_retention: StrictStr | None = None
    # OpenAI platform features a self-hosted server does not have: refused unless null.
    prompt: AnyObject | None = None
    background_options: AnyObject | None = None
    context_management: list[Any] | None = None
    moderation: AnyObject | None = None
    image: AnyObject | None = None
    access_programs: AnyObject | None = None

    def refusal(self) -> ConstraintFieldError | None:
        """The first field this stateless, text-only implementation cannot honour, or None."""
        if self.store:
            return ConstraintFieldError("store", f"true is not supported: {_STATELESS}; send store: false")
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                return ConstraintFieldError(name, f"is not supported: {_STATELESS}; send the whole "
                                                  "conversation as input")
        if self.background:
            return ConstraintFieldError("background", f"true is not supported: {_STATELESS}")
        if self.include:
            return ConstraintFieldError("include", "is not supported (no extra output data)")
        if self.truncation not in (None, "disabled"):
            return ConstraintFieldError("truncation", "only 'disabled' is supported")
        if self.top_logprobs:
            return ConstraintFieldError("top_logprobs", "is not supported on /v1/responses")
        if self.max_tool_calls is not None:
            return ConstraintFieldError("max_tool_calls", "is not supported")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            return ConstraintFieldError("reasoning", "is not supported: the served model does not reason")
        for name, why in _PLATFORM_ONLY.items():
            if getattr(self, name) is not None:
                return ConstraintFieldError(name, f"is not supported: {why}")
        return None

    def response_format(self) -> tuple[dict | None, BodyConstraint | None]:
        """`text.format` as chat's `response_format`, and its constraint named by REST field.

        Raises:
            ConstraintFieldError: naming the `text.*` field at fault.
        """
        text = self.text or {}
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:
            raise ConstraintFieldError(f"text.{unknown[0]}", "is not a text field (format, verbosity)")
        fmt = text.get("format")
        if fmt is None:
            return None, None
        if not isinstance(fmt, dict):
            raise ConstraintFieldError("text.format", "must be an object")
        kind = fmt.get("type")
        if kind == "text":
            return None, None
        if kind == "json_object":
            return {"type": "json_object"}, BodyConstraint("json_object", None, "text.format")
        if kind == "json_schema":
            unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
            if unknown:
                raise ConstraintFieldError(f"text.format.{unknown[0]}",
                                           "is not a json_schema field (name, schema, strict, description)")
            if not isinstance(fmt.get("name", ""), str):
                raise ConstraintFieldError("text.format.name", "must be a string")
            if "schema" not in fmt:
                raise ConstraintFieldError("text.format.schema", "is required")
            schema = schema_field_text(fmt["schema"], "text.format.schema")
            return ({"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                            "schema": json.loads(schema)}},
                    BodyConstraint("json_schema", schema, "text.format.schema"))
        raise ConstraintFieldError("text.format.type", f"must be one of text, json_object, json_schema; got {kind!r}")

    def chat_tools(self) -> tuple[list | None, Any]:
        """`tools` and `tool_choice` in chat's shape (functions nested under "function").

        Raises:
            ConstraintFieldError: a built-in tool or a malformed function, naming `tools[i]`; a
                `tool_choice` naming no function or a built-in tool.
        """
        tools = None
        if self.tools:
            tools = []
            for i, tool in enumerate(self.tools):
                if not isinstance(tool, dict):
                    raise ConstraintFieldError(f"tools[{i}]", "must be an object")
                if tool.get("type") != "function":
                    raise ConstraintFieldError(f"tools[{i}].type", f"{tool.get('type')!r} is not supported: "
                                               "genserve runs no built-in tools; only function tools")
                fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
                tools.append({"type": "function", "function": fn})
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ConstraintFieldError("tool_choice", "must be none, auto, required or "
                                                          "{\"type\": \"function\", \"name\": ...}")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tools, choice

    def messages(self) -> tuple[list[dict], list[str]]:
        """The chat messages of `instructions` and `input`, and for each message the request field
        it came from (``instructions``, ``input``, ``input[3]``), so that an error the chat
        checks raise about ``messages[k]`` names the field the client sent.

        Raises:
            ConstraintFieldError: an input item of a kind or role genserve cannot take, naming it.
        """
        out: list[dict] = []
        sources: list[str] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
            sources.append("instructions")
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}], sources + ["input"]
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            merged = False
            if not isinstance(item, dict):
                raise ConstraintFieldError(where, "must be an object")
            kind = item.get("type", "message")
            if kind == "message":
                role = ROLES.get(item.get("role"))
                if role is None:
                    raise ConstraintFieldError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
                out.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                _check_call_item(item, where)
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)       # parallel calls: one assistant turn
                    merged = True
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str):
                    raise ConstraintFieldError(f"{where}.call_id", "must be the call's id (a string)")
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise ConstraintFieldError(f"{where}.type", f"{kind!r} is not supported (message, "
                                                            "function_call, function_call_output)")
            if not merged:
                sources.append(where)
        return out, sources

    def to_chat(self) -> tuple[ChatCompletionRequest, BodyConstraint | None, list[str]]:
        """The chat request this asks for, the output constraint named by its REST field, and the
        request field of each chat message (`messages`).

        Raises:
            ConstraintFieldError: as `response_format`, `chat_tools` and `messages` do.
            ValidationError: a value the chat request refuses (out-of-range temperature, ...).
        """
        response_format, constraint = self.response_format()
        tools, choice = self.chat_tools()
        messages, sources = self.messages()
        body: dict[str, Any] = {"messages": messages, "stream": bool(self.stream)}
        for name, value in (("model", self.model), ("max_completion_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("seed", self.seed),
                            ("response_format", response_format), ("tools", tools), ("tool_choice", choice),
                            ("parallel_tool_calls", self.parallel_tool_calls)):
            if value is not None:
                body[name] = value
        chat = ChatCompletionRequest.model_validate(body)
        if constraint is None and chat.tool_setup() is not None:
            constraint = chat.constraint()        # the tool-call grammar (rest field "tools")
        return chat, constraint, sources


def _check_call_item(item: dict, where: str) -> None:
    """A `function_call` input item's own fields, named as the client sent them (the chat checks
    would name the tool call they become: ``messages[2].tool_calls[0].function.name``).

    Raises:
        ConstraintFieldError: `call_id` or `name` not a non-empty string, `arguments` not a string.
    """
    for name in ("call_id", "name"):
        if not isinstance(item.get(name), str) or not item[name]:
            raise ConstraintFieldError(f"{where}.{name}", "must be a non-empty string")
    if item.get("arguments") is not None and not isinstance(item["arguments"], str):
        raise ConstraintFieldError(f"{where}.arguments", "must be JSON text (a string)")


def input_field(field: str, sources: list[str]) -> str:
    """A chat error's field (``messages[1].role``) as the Responses request field it came from:
    message k's source (`ResponsesRequest.messages`), so ``input[0].role`` when `instructions` is
    message 0; the whole list (``messages``) is ``input``."""
    m = re.match(r"messages(?:\[(\d+)\])?", field)
    if m is None:
        return field
    k = m.group(1)
    if k is None:
        return "input" + field[m.end():]
    return (sources[int(k)] if int(k) < len(sources) else f"input[{k}]") + field[m.end():]


def _text_of(content: Any, field: str) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConstraintFieldError(field, "must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise ConstraintFieldError(f"{field}[{j}]", f"{kind!r} is not supported: text parts only "
                                                        "(input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)


class ResponseBuilder:
    """Turns one Generate stream (one sample) into a Responses `response` object and its events,
    by translating `bridge.chat.ChatCompletionBuilder`'s chunks.

    Args:
        body: the request (its echoed settings: instructions, tools, text, ...).
        model: the served model's name.
        tools: the request has tools that may be called: the served model's tool-call format
            (bridge/tools.py; True: the generic one), or False.
    """

    def __init__(self, body: ResponsesRequest, *, model: str, tools: bool | ToolFormat) -> None:
        self.body = body
        self.chat = ChatCompletionBuilder(model=model, created=int(time.time()), num_samples=1,
                                          logprobs=False, tools=tools)
        self.id = f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0
        self._text: list[str] = []
        self._message_open = False
        self._calls: list[dict] = []
        self._finish: str | None = None

    @property
    def request_id(self) -> str:
        """The engine's request id (the bridge's X-Request-Id)."""
        return self.chat.request_id

    @request_id.setter
    def request_id(self, value: str) -> None:
        self.chat.request_id = value

    @property
    def all_finished(self) -> bool:
        """Whether the sample has finished."""
        return self.chat.all_finished

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _status(self) -> str:
        """The response's status once the sample has finished: "incomplete" when the token
        limit cut it (`max_output_tokens`), else "completed". Every output item's final status
        is this one, in its `response.output_item.done` event as in the final response."""
        return "incomplete" if self._finish == "length" else "completed"

    def _message_item(self, status: str) -> dict:
        content = [{"type": "output_text", "text": "".join(self._text), "annotations": [], "logprobs": []}]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant",
                "content": content if status != "in_progress" or self._text else []}

    def events_for(self, msg: pb.GenerateResponse) -> list[dict]:
        """Record one message; return the `response.*` events it makes."""
        events: list[dict] = []
        started = msg.WhichOneof("event") == "started"
        for chunk in self.chat.events_for(msg):
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                if delta.get("content"):
                    events += self._open_message()
                    self._text.append(delta["content"])
                    events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                              output_index=0, content_index=0, delta=delta["content"],
                                              logprobs=[]))
                for part in delta.get("tool_calls") or []:
                    events += self._tool_call_part(part)
                if choice.get("finish_reason"):
                    self._finish = choice["finish_reason"]
                    events += self._close()
        if started:
            events = [self._event("response.created", response=self.response("in_progress")),
                      self._event("response.in_progress", response=self.response("in_progress"))]
        return events

    def _open_message(self) -> list[dict]:
        if self._message_open:
            return []
        self._message_open = True
        return [self._event("response.output_item.added", output_index=0, item=self._message_item("in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _tool_call_part(self, part: dict) -> list[dict]:
        if "id" in part:                          # a call's head: id and name
            self._calls.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                "call_id": part["id"], "name": part["function"]["name"], "arguments": ""})
            return [self._event("response.output_item.added", output_index=len(self._calls) - 1,
                                item=dict(self._calls[-1]))]
        call = self._calls[-1]
        call["arguments"] += part["function"]["arguments"]
        call["status"] = "completed"
        index = len(self._calls) - 1
        return [self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                            delta=part["function"]["arguments"]),
                self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            arguments=call["arguments"]),
                self._event("response.output_item.done", output_index=index, item=dict(call))]

    def _close(self) -> list[dict]:
        events: list[dict] = []
        if not self._calls:                       # (each call's item closed with its arguments)
            events += self._open_message()        # an empty answer still has its message
            text = "".join(self._text)
            item = self._message_item(self._status())
            events += [self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                   content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                   content_index=0, part=item["content"][0]),
                       self._event("response.output_item.done", output_index=0, item=item)]
        final = self.response()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=final)]

    def response(self, status: str | None = None) -> dict:
        """The `response` object: `status` given (in_progress), or from how the sample ended
        (completed; incomplete with reason max_output_tokens when cut by the token limit)."""
        incomplete = None
        if status is None:
            status = self._status()
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        output: list[dict] = []
        if status != "in_progress":
            output = [dict(c, status="completed") for c in self._calls] if self._calls \
                else [self._message_item(status)]
        usage = None
        if status != "in_progress":
            u = self.chat.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.chat.created, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "model": self.chat.model, "output": output,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": b.temperature, "top_p": b.top_p,
                "text": b.text or {"format": {"type": "text"}},
                "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
                "tools": b.tools or [], "truncation": "disabled", "usage": usage,
                "metadata": b.metadata or {}, "user": b.user}

    def completion(self) -> dict:
        """The whole `response` object (for stream=false)."""
        return self.response()


async def create_response(body: ResponsesRequest, request: Request,
                          state: Annotated[BridgeState, Depends(bridge_state)]) -> Response:
    """POST /v1/responses: one Generate call, answered as a `response` object or (`stream`) as
    `response.*` SSE events (`ResponseBuilder`).

    Raises ApiError: 400 naming the field at fault: an unknown field or a wrong type, a field that
    needs stored state or a built-in tool (`ResponsesRequest.refusal`), a malformed `text.format`,
    tool or input item, a schema the grammar engine refuses (`text.format.schema`); otherwise as
    `bridge.chat.chat_completions` does.
    """
    sources: list[str] = []
    try:
        refused = body.refusal()
        if refused is not None:
            raise refused
        chat, constraint, sources = body.to_chat()
        if chat.uses_tools():
            chat.use_tool_format(await state.tool_format(auth_metadata(request)))
        request_id = request.headers.get("x-request-id") or f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"
        proto = chat.to_proto(request_id=request_id)
    except ConstraintFieldError as e:
        raise ApiError(400, e.message, code="invalid_argument", param=e.field) from None
    except ValidationError as e:
        raise validation_error(e.errors()) from None       # the chat field's name: the same as ours
    except ChatError as e:
        param = input_field(e.field, sources)
        raise ApiError(400, f"{param}: {e.message}", code="invalid_argument", param=param) from None
    builder = ResponseBuilder(body, model=state.model_name,
                              tools=chat.tool_format if chat.tool_setup() is not None else False)
    return await generate(request, state, ROUTE, proto, builder, bool(body.stream),
                          fields=engine_fields(constraint, sources))


def engine_fields(constraint: BodyConstraint | None, sources: list[str]) -> dict[str, str]:
    """gRPC request field -> the Responses field it came from, for naming an engine error's field
    (`bridge.errors.rename_param`): `max_tokens` is `max_output_tokens`, chat message k is the
    input item it came from (`ResponsesRequest.messages`' sources), the messages as a whole
    `input`, and the output constraint its field (``text.format.schema``, or ``tools`` for the
    tool-call grammar)."""
    names = {"max_tokens": "max_output_tokens", "messages": "input"}
    names.update({f"messages[{k}]": source for k, source in enumerate(sources)})
    if constraint is not None:
        names.update(constraint.rest_fields())
    return names
