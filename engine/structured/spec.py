"""What a request asks its output to follow, and that ask as an llguidance grammar.

A `ConstraintSpec` is one of five kinds:

* ``json_schema``: the output is one JSON value that validates against a JSON Schema (draft
  2020-12 as llguidance reads it: objects, arrays with bounds, enums, consts, integer and number
  ranges, string lengths and patterns, required and optional keys, anyOf/oneOf, $ref/$defs);
* ``json_object``: any JSON object (OpenAI's ``{"type": "json_object"}``);
* ``regex``: the whole output matches the regular expression (Rust ``regex`` syntax);
* ``choice``: the output is exactly one of the given strings;
* ``grammar``: a Lark grammar in llguidance's dialect (``start`` is the top rule; it may embed
  JSON schemas with ``%json {...}``), what vLLM's ``structured_outputs.grammar`` takes.

`canonical_key` is the cache key of the compiled grammar: the kind and, for JSON, the schema
re-serialised without whitespace, so two requests that send the same schema formatted
differently share one compilation. Key order is kept: it is the order of the object's
properties in the output (a pydantic model's field order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from genserve.common.json_schemas import JSON_OUTPUT_OPTIONS, close_objects, schema_text

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Bounds on what a request may ask: the text handed to the grammar compiler (a 64 KiB schema
# compiles in well under a second) and the number and length of choices.
MAX_SOURCE_CHARS = 65_536
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_024
# JSON output is compact (no whitespace between tokens outside strings): the answer is one line,
# parses the same, and the model cannot spend its max_tokens on indentation. The same options
# hold for JSON embedded in a grammar (bridge/tools.py's tool calls).
JSON_OPTIONS = JSON_OUTPUT_OPTIONS
# OpenAI's json_object mode: any object.
ANY_OBJECT_SCHEMA = {"type": "object"}


class ConstraintError(ValueError):
    """A constraint that cannot be used: the message says why (a 400 naming `field`).

    Attributes:
        field: the request field at fault, e.g. "response_format.json_schema.schema".
        reason: the reason alone, without the field.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """One output constraint, as text.

    Attributes:
        kind: one of `KINDS`.
        source: the JSON schema (JSON text), the regex, the Lark grammar, or the choices as a
            JSON array of strings; "" for json_object.
        field: the request field it came from (errors name it).
    """

    kind: str
    source: str
    field: str = "constraint"

    @classmethod
    def json_schema(cls, schema: dict | bool | str, field: str = "json_schema") -> "ConstraintSpec":
        """A JSON-schema constraint; `schema` as an object or as JSON text.

        Raises:
            ConstraintError: the text is not JSON, or the schema is neither an object nor a bool.
        """
        if isinstance(schema, str):
            if len(schema) > MAX_SOURCE_CHARS:
                raise ConstraintError(field, f"is {len(schema)} characters; the limit is {MAX_SOURCE_CHARS}")
        try:
            text = schema_text(schema)
        except ValueError as e:
            raise ConstraintError(field, str(e)) from None
        return cls("json_schema", text, field)

    @classmethod
    def choices(cls, options: list[str], field: str = "choice") -> "ConstraintSpec":
        """The output is exactly one of `options` (1..MAX_CHOICES strings, each non-empty).

        Raises:
            ConstraintError: no options, too many, an empty or too long one, or a non-string.
        """
        if not isinstance(options, list) or not options:
            raise ConstraintError(field, "must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise ConstraintError(field, f"has {len(options)} choices; the limit is {MAX_CHOICES}")
        for i, option in enumerate(options):
            if not isinstance(option, str) or not 0 < len(option) <= MAX_CHOICE_CHARS:
                raise ConstraintError(f"{field}[{i}]", f"must be a string of 1 to {MAX_CHOICE_CHARS} characters")
        return cls("choice", json.dumps(options, separators=(",", ":")), field)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(self.field, f"unknown constraint kind {self.kind!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise ConstraintError(self.field, f"is {len(self.source)} characters; the limit is {MAX_SOURCE_CHARS}")
        if self.kind in ("regex", "grammar") and not self.source:
            raise ConstraintError(self.field, "must not be empty")

    @property
    def canonical_key(self) -> str:
        """The compiled grammar's cache key (the kind, then the canonical source)."""
        return f"{self.kind}\x00{self.source}"

    def to_grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint.

        Raises:
            ConstraintError: llguidance refuses the schema, the regex or the grammar (its
                message is the reason).
        """
        import llguidance

        try:
            if self.kind == "json_schema":          # unlisted keys are not generated (json_schemas.py)
                schema = close_objects(json.loads(self.source))
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                alternatives = " | ".join(json.dumps(o, ensure_ascii=False) for o in json.loads(self.source))
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        except ValueError as e:
            raise ConstraintError(self.field, str(e)) from None
