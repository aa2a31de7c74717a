"""The structured-output request forms, and the one mapping from them to `StructuredOutputsParams`.

A request asks for constrained output in one of three dialects, on /v1/completions and
/v1/chat/completions alike:

* OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}` (a schema; `schema` absent: any JSON object);
* vLLM's `structured_outputs`: one of `json | regex | choice | grammar | json_object |
  structural_tag`, with `disable_any_whitespace`, `disable_additional_properties`,
  `whitespace_pattern`;
* vLLM's legacy fields: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, with
  `guided_whitespace_pattern` and `guided_decoding_backend`.

`structured_outputs_params` turns whichever is set into the engine's `StructuredOutputsParams`.
Two constraints at once (a `response_format` json_schema and a `guided_regex`, two `guided_*`
fields, two forms inside `structured_outputs`) is a 400 naming the second one: which one wins
would be a guess. The options (`guided_whitespace_pattern`, `guided_decoding_backend`) apply to
whichever form is set, and are a 400 when none is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sonar.errors import InvalidRequestError
from sonar.sampling_params import SamplingParamsError, StructuredOutputsParams

#: The backends a request may name (`guided_decoding_backend`), as --structured-outputs-config's.
BACKENDS = ("auto", "xgrammar", "guidance")

#: The `response_format` types OpenAI defines.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    #: Absent: any JSON object (as OpenAI).
    schema: dict[str, Any] | None = None
    description: str | None = None
    #: Sonar always enforces the schema; `strict: false` is accepted and gets the same guarantee.
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format`: "text", "json_object" or "json_schema" (with `json_schema`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request field (one form set; see `StructuredOutputsParams`)."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


def structured_outputs_params(
    *,
    response_format: ResponseFormat | None = None,
    structured_outputs: StructuredOutputsRequest | None = None,
    guided_json: str | dict[str, Any] | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    guided_decoding_backend: str | None = None,
    guided_whitespace_pattern: str | None = None,
) -> StructuredOutputsParams | None:
    """The constraint a request's structured-output fields ask for (None: free text), or an
    `InvalidRequestError` (400) naming the field that is wrong or one too many."""
    forms: list[tuple[str, dict[str, Any]]] = []  # (the field that set it, StructuredOutputsParams kwargs)
    if response_format is not None:
        form = _response_format(response_format)
        if form is not None:
            forms.append(("response_format", form))
    if structured_outputs is not None:
        forms.append(("structured_outputs", _structured_outputs(structured_outputs)))
    legacy = (
        ("guided_json", guided_json),
        ("guided_regex", guided_regex),
        ("guided_choice", guided_choice),
        ("guided_grammar", guided_grammar),
    )
    for field, value in legacy:
        if value is not None:
            forms.append((field, {field.removeprefix("guided_"): value}))
    if len(forms) > 1:
        raise InvalidRequestError(
            f"{forms[1][0]} cannot be combined with {forms[0][0]}: a request asks for one structured output",
            param=forms[1][0],
        )
    if not forms:
        for option, value in (
            ("guided_decoding_backend", guided_decoding_backend),
            ("guided_whitespace_pattern", guided_whitespace_pattern),
        ):
            if value is not None:
                raise InvalidRequestError(
                    f"{option} needs a structured output to apply to (response_format, structured_outputs or "
                    "a guided_* field)",
                    param=option,
                )
        return None
    field, kwargs = forms[0]
    if guided_decoding_backend is not None:
        if guided_decoding_backend not in BACKENDS:
            raise InvalidRequestError(
                f"guided_decoding_backend must be one of {', '.join(BACKENDS)}, got {guided_decoding_backend!r}",
                param="guided_decoding_backend",
            )
        kwargs["backend"] = guided_decoding_backend
    if guided_whitespace_pattern is not None:
        if kwargs.get("whitespace_pattern") not in (None, guided_whitespace_pattern):
            raise InvalidRequestError(
                "guided_whitespace_pattern and structured_outputs.whitespace_pattern differ",
                param="guided_whitespace_pattern",
            )
        kwargs["whitespace_pattern"] = guided_whitespace_pattern
    try:
        return StructuredOutputsParams(**kwargs)
    except SamplingParamsError as exc:
        raise InvalidRequestError(str(exc).removeprefix("structured_outputs: "), param=field) from None


def _response_format(fmt: ResponseFormat) -> dict[str, Any] | None:
    if fmt.type not in RESPONSE_FORMAT_TYPES:
        raise InvalidRequestError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {fmt.type!r}",
            param="response_format.type",
        )
    if fmt.type != "json_schema" and fmt.json_schema is not None:
        raise InvalidRequestError(
            f"response_format.json_schema is only read with type 'json_schema', not {fmt.type!r}",
            param="response_format.json_schema",
        )
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format of type 'json_schema' needs its `json_schema` object (name, schema)",
            param="response_format.json_schema",
        )
    if fmt.json_schema.schema is None:
        return {"json_object": True}
    return {"json": fmt.json_schema.schema}


def _structured_outputs(so: StructuredOutputsRequest) -> dict[str, Any]:
    kwargs = {name: value for name, value in msgspec.structs.asdict(so).items() if value is not None}
    if kwargs.get("json_object") is False:  # false asks for nothing: as if absent
        del kwargs["json_object"]
    return kwargs
