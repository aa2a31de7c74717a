"""The `json-schema` benchmark dataset: every request asks for JSON under one of a set of schemas.

The schemas are the shapes agents ask for (a person, an order with line items, a calendar event
with enums and formats, a nested review); request `i` takes schema `i % len(SCHEMAS)`. Options:

* ``--json-schema-unique``: each request's schema gets a property named after the request, so no
  two schemas are alike and every grammar compiles cold (the worst case for the compile cache).
* ``--json-schema-min-chars N``: the first property is a free-text ``notes`` string of at least N
  characters, so every request runs to its ``max_tokens`` under the grammar: a run without schemas
  (``--json-schema-off``, with ``--ignore-eos``) then generates the same number of tokens, and
  the two output rates compare the grammar's cost alone.
* ``--json-schema-off``: the same prompts and lengths with no schema sent.
"""

from __future__ import annotations

import copy
from typing import Any

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}
_ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["order_id", "items", "paid"],
    "additionalProperties": False,
}
_EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
        "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 6},
        "location": {
            "anyOf": [
                {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]},
                {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]},
            ]
        },
    },
    "required": ["title", "day", "start", "attendees", "location"],
}
_REVIEW = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 60},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        "cons": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"],
        },
    },
    "required": ["product", "rating", "pros", "cons", "author"],
}

SCHEMAS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("a person who works at a bakery", _PERSON),
    ("an online order of garden tools", _ORDER),
    ("a team meeting next week", _EVENT),
    ("a review of a pair of running shoes", _REVIEW),
)


def schema_request(index: int, *, unique: bool, min_chars: int) -> tuple[str, dict[str, Any]]:
    """The prompt and the schema of request `index` (see the module's options)."""
    subject, base = SCHEMAS[index % len(SCHEMAS)]
    schema = copy.deepcopy(base)
    if min_chars:
        # First, so the grammar is in it until max_tokens ends the request.
        props = {"notes": {"type": "string", "minLength": min_chars}, **schema["properties"]}
        schema["properties"] = props
        schema["required"] = ["notes", *schema["required"]]
    if unique:
        schema["properties"][f"request_{index}"] = {"type": "integer"}
        schema["required"] = [*schema["required"], f"request_{index}"]
    prompt = f"Describe {subject} as a JSON object that follows this schema, and nothing else."
    return prompt, schema
