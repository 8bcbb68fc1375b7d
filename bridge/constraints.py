"""Output constraints in a REST body → the GenerateRequest's `constraint` oneof.

Three spellings ask for the same thing, and a body may use one of them:

* OpenAI's ``response_format`` (chat): ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
* vLLM's ``structured_outputs``: an object with one of ``json`` (a schema, as an object or JSON
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark) or ``json_object: true``;
* vLLM's older top-level names ``guided_json``, ``guided_regex``, ``guided_choice`` and
  ``guided_grammar``.

Shape errors are a 400 naming the REST field here; whether a schema, regex or grammar compiles is
the engine's to say (an INVALID_ARGUMENT naming the gRPC field, which `rest_field` turns back into
the REST field the client sent, e.g. ``response_format.json_schema.schema``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genserve.common.json_schemas import schema_text
from genserve.v1 import generate_pb2 as pb

# The structured_outputs keys that select a constraint, and the gRPC oneof field each sets.
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
# vLLM's older names (top-level fields) → the gRPC field.
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class ConstraintFieldError(ValueError):
    """A constraint field of the wrong shape: a 400 naming `field`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


@dataclass(frozen=True, slots=True)
class BodyConstraint:
    """The one constraint a body asks for.

    Attributes:
        grpc_field: the GenerateRequest oneof member ("json_schema", "json_object", "regex",
            "choice", "grammar").
        value: its value: schema JSON text, regex, Lark text, list of choices, or None.
        rest_field: the body field it came from, as errors name it.
    """

    grpc_field: str
    value: Any
    rest_field: str

    def set_on(self, request: pb.GenerateRequest) -> None:
        """Set the request's `constraint` oneof."""
        if self.grpc_field == "json_object":
            request.json_object.SetInParent()
        elif self.grpc_field == "choice":
            request.choice.options.extend(self.value)
        else:
            setattr(request, self.grpc_field, self.value)

    def rest_fields(self) -> dict[str, str]:
        """{gRPC field: REST field} of this constraint, for naming an engine error's field
        (`bridge.errors.client_field`: ``choice[0]`` -> ``guided_choice[0]``)."""
        return {self.grpc_field: self.rest_field}


def schema_field_text(value: Any, field: str) -> str:
    """`genserve.common.json_schemas.schema_text` of a body field's schema.

    Raises:
        ConstraintFieldError: naming `field`: not JSON, or not a schema object.
    """
    try:
        return schema_text(value)
    except ValueError as e:
        raise ConstraintFieldError(field, str(e)) from None


def _value(grpc_field: str, value: Any, field: str) -> Any:
    if grpc_field == "json_schema":
        return schema_field_text(value, field)
    if grpc_field == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ConstraintFieldError(field, "must be a non-empty list of strings")
        return value
    if grpc_field == "json_object":
        if value is not True:
            raise ConstraintFieldError(field, "must be true")
        return None
    if not isinstance(value, str) or not value:
        raise ConstraintFieldError(field, "must be a non-empty string")
    return value


def from_response_format(value: dict | None) -> BodyConstraint | None:
    """OpenAI's `response_format` (None or `{"type": "text"}`: no constraint).

    Raises:
        ConstraintFieldError: an unknown type, or a `json_schema` without its object.
    """
    if value is None:
        return None
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise ConstraintFieldError(f"response_format.{sorted(extra)[0]}", "is not a response_format field")
    if kind == "text":
        return None
    if kind == "json_object":
        return BodyConstraint("json_object", None, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintFieldError("response_format.json_schema", "must be an object with name and schema")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ConstraintFieldError(f"response_format.json_schema.{sorted(unknown)[0]}",
                                       "is not a json_schema field (name, schema, strict, description)")
        if not isinstance(spec.get("name", ""), str):
            raise ConstraintFieldError("response_format.json_schema.name", "must be a string")
        field = "response_format.json_schema.schema"
        return BodyConstraint("json_schema", schema_field_text(spec.get("schema", {}), field), field)
    raise ConstraintFieldError("response_format.type", "must be one of text, json_object, json_schema; "
                                                       f"got {kind!r}")


def from_structured_outputs(value: dict | None) -> BodyConstraint | None:
    """vLLM's `structured_outputs` object (exactly one of its constraint keys).

    Raises:
        ConstraintFieldError: no key or several, an unknown key, or a value of the wrong shape.
    """
    if value is None:
        return None
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        raise ConstraintFieldError(f"structured_outputs.{unknown[0]}",
                                   f"is not supported (one of {', '.join(STRUCTURED_KEYS)})")
    keys = [k for k, v in value.items() if v is not None]
    if len(keys) != 1:
        raise ConstraintFieldError("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_KEYS)}")
    key = keys[0]
    field = f"structured_outputs.{key}"
    grpc_field = STRUCTURED_KEYS[key]
    return BodyConstraint(grpc_field, _value(grpc_field, value[key], field), field)


def body_constraint(values: dict[str, Any]) -> BodyConstraint | None:
    """The constraint of a body's fields (`response_format`, `structured_outputs`, `guided_*`;
    null means absent), or None.

    Raises:
        ConstraintFieldError: a malformed one, or more than one asked for.
    """
    found = []
    if values.get("response_format") is not None:
        c = from_response_format(values["response_format"])
        if c is not None:
            found.append(c)
    if values.get("structured_outputs") is not None:
        found.append(from_structured_outputs(values["structured_outputs"]))
    for name, grpc_field in GUIDED_FIELDS.items():
        if values.get(name) is not None:
            found.append(BodyConstraint(grpc_field, _value(grpc_field, values[name], name), name))
    if len(found) > 1:
        raise ConstraintFieldError(found[1].rest_field, f"only one output constraint per request; "
                                                        f"{found[0].rest_field} is already one")
    return found[0] if found else None
