"""The honest contract over a real `python -m sonar serve`: every request field of /v1/completions
and /v1/chat/completions takes effect or is refused with a 400 naming it (docs/openai_fields.md),
and a wrong value is a 400 naming it. The pure side (decoding, the table, the structured-output
forms) is tests/http/test_protocol.py and tests/http/test_structured.py.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Iterator

import httpx
import jsonschema
import pytest

from sonar.http.protocol import CHAT_REFUSED, COMPLETION_REFUSED
from tests.http.conftest import ServerProcess

MODEL = "smol"
STORY = "Once upon a time,"
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(plain_server: ServerProcess) -> ServerProcess:
    """The package's plain server (tests/http/conftest.py): no tool parser, requests logged."""
    return plain_server


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def expect_error(response: httpx.Response, status: int, param: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    return error


# -- refused fields ----------------------------------------------------------------------------------
def _refused_cases() -> list[tuple[str, str]]:
    return [("/v1/completions", name) for name in COMPLETION_REFUSED] + [
        ("/v1/chat/completions", name) for name in CHAT_REFUSED
    ]


@pytest.mark.parametrize(
    "path, field",
    _refused_cases(),
    ids=[f"{'cmpl' if p == '/v1/completions' else 'chat'}-{f}" for p, f in _refused_cases()],
)
def test_each_refused_field_is_a_400_naming_it(http, path: str, field: str):
    body = {"model": MODEL, "max_tokens": 1}
    body.update({"prompt": STORY} if path == "/v1/completions" else {"messages": MESSAGES})
    refusal = (COMPLETION_REFUSED if path == "/v1/completions" else CHAT_REFUSED)[field]
    value = not any(v is True for v in refusal.inert)
    error = expect_error(http.post(path, json={**body, field: value}), 400, field)
    assert error["message"] == f"{field} is not supported: {refusal.reason}"
    # Null, and a value that asks for what Sonar does anyway, pass.
    for passing in (None, *refusal.inert):
        r = http.post(path, json={**body, field: passing})
        assert r.status_code == 200, (field, passing, r.text)


WRONG_VALUES = [
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role", "must be one of system, developer"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "must not be null"),
    (
        {"messages": [*MESSAGES, {"role": "tool", "content": "42"}]},
        "messages[1].tool_call_id",
        "needs the tool_call_id",
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "not valid JSON",
    ),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be one of none, auto, required"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "has no tools"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        "tool_choice.function.name",
        "not in tools (get_weather)",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "get_weather"}}]},  # tool_choice absent: auto
        "tool_choice",
        "tool_choice 'auto' needs the server started with --enable-auto-tool-choice",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its `json_schema`"),
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "[a-z]+"},
        "guided_regex",
        "cannot be combined with response_format",
    ),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "auto, xgrammar"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "cannot set 'tools'"),
    ({"stream_options": {"continuous_usage_stats": True}, "stream": True}, "stream_options", "continuous_usage_stats"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
]


@pytest.mark.parametrize("fields, param, words", WRONG_VALUES, ids=[w[1] for w in WRONG_VALUES])
def test_a_wrong_value_is_a_400_naming_it(http, fields: dict[str, Any], param: str, words: str):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **fields}
    error = expect_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert words in error["message"], error


SMALL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def _json_schema_holds(text: str) -> bool:
    jsonschema.validate(json.loads(text), SMALL_SCHEMA)
    return True


def _json_object(text: str) -> bool:
    """SmolLM2 tends to nest objects until max_tokens (the one form here that may end in
    "length"): what it wrote must open an object."""
    return text.startswith("{")


STRUCTURED_FORMS = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SMALL_SCHEMA}}},
        _json_schema_holds,
    ),
    ({"response_format": {"type": "json_object"}}, _json_object),
    ({"structured_outputs": {"json": SMALL_SCHEMA}}, _json_schema_holds),
    (
        {"structured_outputs": {"regex": "[0-9]{2,3}"}},
        lambda text: re.fullmatch("[0-9]{2,3}", text),
    ),
    ({"guided_json": json.dumps(SMALL_SCHEMA), "guided_decoding_backend": "guidance"}, _json_schema_holds),
    ({"guided_regex": "(yes|no)!", "guided_decoding_backend": "xgrammar"}, lambda text: text in ("yes!", "no!")),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"guided_grammar": 'root ::= "A" [0-9] [0-9]'}, lambda text: re.fullmatch("A[0-9]{2}", text)),
]


@pytest.mark.parametrize(
    "fields, holds",
    STRUCTURED_FORMS,
    ids=[
        "json_schema",
        "json_object",
        "structured_outputs.json",
        "structured_outputs.regex",
        "guided_json+guidance",
        "guided_regex+xgrammar",
        "guided_choice",
        "guided_grammar",
    ],
)
def test_structured_outputs_take_effect_on_both_endpoints(http, fields: dict[str, Any], holds: Any):
    ask = "Reply with a small JSON object: the key name set to a city."
    chat, prompt = [{"role": "user", "content": ask}], f"{ask}\nJSON:"
    for path, base in (("/v1/chat/completions", {"messages": chat}), ("/v1/completions", {"prompt": prompt})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 48, "temperature": 0, **base, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" or holds is _json_object, (path, text)
        assert holds(text), (path, text)


def test_a_spec_that_does_not_compile_is_a_400_naming_structured_outputs(http):
    for fields in (
        {"guided_regex": "(unclosed"},
        {"guided_json": {"type": "no-such-type"}},
        {"guided_grammar": "root ::= "},
    ):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES, **fields})
        expect_error(r, 400, "structured_outputs")
    # response_format text is no constraint: served.
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 2, "messages": MESSAGES, "response_format": {"type": "text"}},
    )
    assert r.status_code == 200, r.text


def test_user_is_written_in_the_request_log(server, http):
    """`user` is metadata: its one effect is the request log line (--enable-log-requests)."""
    users = {
        "/v1/chat/completions": ("alice-7", {"messages": MESSAGES}),
        "/v1/completions": ("bob-9", {"prompt": STORY}),
    }
    for path, (user, base) in users.items():
        r = http.post(path, json={"model": MODEL, "max_tokens": 1, "user": user, **base})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [line for line in server.log().splitlines() if "request.received" in line]
        if all(any(user in line for line in lines) for user, _ in users.values()):
            return
        time.sleep(0.1)
    pytest.fail(f"no request.received line names the user:\n{server.log()[-3000:]}")


def test_smollm2s_own_template_renders_a_conversation_with_tool_calls(http):
    """SmolLM2's template knows no tools: the history still renders (null content as empty text,
    developer as system), and tool_choice none serves it."""
    conversation = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    tokens = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n18 C<|im_end|>" in text and "None" not in text
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": conversation, "tools": [tool], "tool_choice": "none", "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
