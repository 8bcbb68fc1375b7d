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


def test_an_embedded_schema_keeps_its_references():
    """A schema placed inside another (a tool's parameters in the call grammar's schema) has
    every local reference rebased to where it now stands: pydantic's $defs/$ref, a recursive
    "#", references inside $defs and anyOf; non-local references and the root's $id/$schema
    are handled as the docstring says. The rebased schema, put in place, validates the same
    instances as the original."""
    from genserve.common.json_schemas import embed_schema

    params = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:person",
              "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]},
                        "Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"},
                                                                                     {"type": "null"}]}}}},
              "type": "object",
              "properties": {"home": {"$ref": "#/$defs/Address"}, "chain": {"$ref": "#/$defs/Node"},
                             "boss": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                             "remote": {"$ref": "https://example.com/x.json"}},
              "required": ["home"]}
    embedded = embed_schema(params, "/anyOf/1/properties/arguments")
    assert "$id" not in embedded and "$schema" not in embedded
    assert embedded["properties"]["home"]["$ref"] == "#/anyOf/1/properties/arguments/$defs/Address"
    assert embedded["properties"]["boss"]["anyOf"][0]["$ref"] == "#/anyOf/1/properties/arguments"
    assert embedded["$defs"]["Node"]["properties"]["next"]["anyOf"][0]["$ref"] == \
        "#/anyOf/1/properties/arguments/$defs/Node"
    assert embedded["properties"]["remote"]["$ref"] == "https://example.com/x.json"
    assert params["properties"]["home"]["$ref"] == "#/$defs/Address"          # the original is untouched
    del embedded["properties"]["remote"], params["properties"]["remote"]
    outer = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"arguments": embedded}}]}
    good = {"home": {"city": "Paris"}, "chain": {"next": {"next": None}}, "boss": {"home": {"city": "Rome"}}}
    bad = {"home": {"city": 3}}
    del params["$id"]
    jsonschema.validate(good, params)
    jsonschema.validate({"arguments": good}, outer)
    for schema, instance in ((params, bad), (outer, {"arguments": bad})):
        assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
