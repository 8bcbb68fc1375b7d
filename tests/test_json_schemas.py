"""genserve/common/json_schemas.py: objects that list properties are closed for generation, and
what must stay open stays open; every answer the closed schema admits validates against the
original."""

from __future__ import annotations

import jsonschema

from genserve.common.json_schemas import close_objects


def test_listed_objects_close_and_the_rest_stays_open():
    schema = {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "free": {"type": "object"},
        "mapped": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        "list": {"type": "array", "items": {"properties": {"y": {}}}},
        "either": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]}},
        "allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}],
        "$defs": {"d": {"type": "object", "properties": {"k": {}}}}}
    closed = close_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["inner"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["mapped"]["additionalProperties"] == {"type": "string"}
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in s for s in closed["allOf"])
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["inner"]


def test_what_the_closed_schema_admits_the_original_admits():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name"]}
    closed = close_objects(schema)
    for value in ({"name": "a"}, {"name": "b", "n": 3}):
        jsonschema.validate(value, closed)
        jsonschema.validate(value, schema)
    try:
        jsonschema.validate({"name": "a", "description": "x"}, closed)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("an unlisted key passed the closed schema")
    jsonschema.validate({"name": "a", "description": "x"}, schema)
