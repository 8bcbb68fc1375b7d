"""JSON Schemas as clients send them: one canonical text (`schema_text`), closing a schema's
objects for generation (`close_objects`): unlisted keys are not generated, and placing a schema
inside another (`embed_schema`): its references still find their definitions.

JSON Schema lets an object with `properties` carry any other key unless it says
``"additionalProperties": false``, and most schemas made from code (pydantic's, LangChain's tool
schemas) do not say it. A constrained model is then free to keep inventing keys, and a small one
does: asked for a tool call with pydantic's schema of a three-field model, SmolLM2 wrote one
``"description"`` key after another until `max_tokens` cut the call (the answer was not a call,
and LangChain returned None). Generating with ``additionalProperties: false`` added wherever an
object lists its `properties` and says nothing about other keys gives answers that still validate
against the schema as sent: it only removes answers, never admits one the schema refuses.
xgrammar, vLLM's default grammar engine, does the same by default (its "strict mode").

Left open: objects without `properties` (``{"type": "object"}`` means any object), objects that
say anything about other keys (`additionalProperties`, `patternProperties`,
`unevaluatedProperties`), and the members of an `allOf` (closing one member would refuse the keys
another member lists).
"""

from __future__ import annotations

import json
from typing import Any

# How generated JSON is written: compact, no whitespace between tokens outside strings (the answer
# parses the same, and the model cannot spend its max_tokens on indentation or on blank space
# inside an empty object). llguidance reads these options from a schema's "x-guidance" key.
JSON_OUTPUT_OPTIONS = {"whitespace_flexible": False}
# Keywords whose value is one schema, or a list of schemas, or a name → schema mapping.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "additionalProperties", "unevaluatedItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def schema_text(value: Any) -> str:
    """A JSON Schema, sent as an object (a dict, or a bool schema) or as JSON text, as compact
    JSON text (the same schema always gives the same text, so it can key a compile cache).

    Raises:
        ValueError: the reason alone (the caller names the field): the text is not JSON, or the
            schema is neither an object nor a bool.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError("must be a JSON Schema object")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def close_objects(schema: Any, *, close: bool = True) -> Any:
    """A copy of `schema` with ``"additionalProperties": false`` on every object that lists
    `properties` and says nothing about other keys (see the module docstring for what stays open).

    Args:
        schema: a JSON Schema (dict or bool; anything else is returned as is).
        close: whether this node itself may be closed (False for the members of an allOf).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, close=False) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def embed_schema(schema: Any, pointer: str) -> Any:
    """A copy of `schema` fit to stand at `pointer` (a JSON pointer, "/anyOf/0/properties/x")
    inside a larger schema: every local reference (``"$ref": "#/$defs/Item"``, or ``"#"`` for the
    schema itself) is rewritten to point to the same place below `pointer`
    (``"#/anyOf/0/properties/x/$defs/Item"``), since a ``#`` reference resolves against the
    document's root, which is no longer this schema's. A root ``$id`` or ``$schema`` is dropped
    (they mean something only at a document's root); references that are not local (a URI) are
    left as they are.

    pydantic (and so the openai SDK's `pydantic_function_tool`, LangChain and instructor) writes a
    nested model as ``$defs`` plus ``$ref``; without this, a tool's parameters embedded into the
    call grammar point to definitions that are not there.
    """
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k not in ("$id", "$schema")}
    return _rebase(out, "#" + pointer)


def _rebase(schema: Any, base: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _rebase(out[key], base)
    for key in (*_MANY, "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_rebase(s, base) for s in out[key]]
    if isinstance(out.get("items"), list):          # draft 4-7's tuple form
        out["items"] = [_rebase(s, base) for s in out["items"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _rebase(s, base) for name, s in out[key].items()}
    return out
