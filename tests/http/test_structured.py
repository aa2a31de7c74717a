"""Every structured-output request form, decoded from JSON as a client sends it, to the
`StructuredOutputsParams` the engine receives (or the 400 naming what is wrong)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sonar.errors import InvalidRequestError
from sonar.http.protocol import ChatCompletionRequest, CompletionRequest, decode_request
from sonar.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
GRAMMAR = 'root ::= "yes" | "no"'


def constraint(kind: type = ChatCompletionRequest, **fields: Any) -> StructuredOutputsParams | None:
    base = {"messages": [{"role": "user", "content": "Hi"}]} if kind is ChatCompletionRequest else {"prompt": "Hi"}
    return decode_request(json.dumps({**base, **fields}).encode(), kind).sampling_params().structured_outputs


FORMS = [
    # OpenAI's response_format.
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
        StructuredOutputsParams(json=SCHEMA),
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "description": "a city"}}},
        StructuredOutputsParams(json_object=True),  # no schema: any object
    ),
    # vLLM's structured_outputs: each form, and the options.
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputsParams(regex="[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutputsParams(grammar=GRAMMAR)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"structural_tag": '{"x": 1}'}}, StructuredOutputsParams(structural_tag='{"x": 1}')),
    (
        {
            "structured_outputs": {
                "json": SCHEMA,
                "disable_any_whitespace": True,
                "disable_additional_properties": True,
                "whitespace_pattern": " ?",
            }
        },
        StructuredOutputsParams(
            json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True, whitespace_pattern=" ?"
        ),
    ),
    # The legacy guided_* fields, with the backend and the whitespace pattern.
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "a+"}, StructuredOutputsParams(regex="a+")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR)),
    (
        {"guided_json": SCHEMA, "guided_decoding_backend": "guidance", "guided_whitespace_pattern": "[ ]?"},
        StructuredOutputsParams(json=SCHEMA, backend="guidance", whitespace_pattern="[ ]?"),
    ),
    (
        {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"},
        StructuredOutputsParams(regex="a+", backend="xgrammar"),
    ),
    (
        {"response_format": {"type": "json_object"}, "guided_decoding_backend": "auto"},
        StructuredOutputsParams(json_object=True, backend="auto"),
    ),
    ({}, None),
]


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest], ids=["chat", "completions"])
@pytest.mark.parametrize("fields, expected", FORMS, ids=[json.dumps(f)[:60] for f, _ in FORMS])
def test_each_form_maps_to_its_constraint(kind: type, fields: dict[str, Any], expected: Any):
    assert constraint(kind, **fields) == expected


WRONG = [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its `json_schema` object"),
    (
        {"response_format": {"type": "json_object", "json_schema": {"name": "w"}}},
        "response_format.json_schema",
        "only read with type 'json_schema'",
    ),
    (
        {
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
            "guided_regex": "a",
        },
        "guided_regex",
        "cannot be combined with response_format",
    ),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "cannot be combined with guided_json"),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "cannot be combined with response_format",
    ),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "got regex, choice"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one string"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "auto, xgrammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "needs a structured output"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "needs a structured output"),
    (
        {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}, "guided_whitespace_pattern": "  "},
        "guided_whitespace_pattern",
        "differ",
    ),
]


@pytest.mark.parametrize("fields, param, words", WRONG, ids=[p + "-" + w for _, p, w in WRONG])
def test_a_wrong_form_is_a_400_naming_it(fields: dict[str, Any], param: str, words: str):
    for kind in (ChatCompletionRequest, CompletionRequest):
        with pytest.raises(InvalidRequestError) as info:
            constraint(kind, **fields)
        assert info.value.status == 400 and info.value.param == param
        assert words in str(info.value), str(info.value)
