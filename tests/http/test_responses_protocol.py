"""The Responses API's request side as plain values: input items to chat-template messages,
`text.format` to the engine's structured outputs, sampling, and each refusal naming its field."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sonar.http.protocol import RequestError
from sonar.http.responses_protocol import (
    IMAGES,
    REFUSED,
    ResponseObject,
    ResponsesRequest,
    decode_responses_request,
    input_messages,
)
from sonar.sampling_params import StructuredOutputsParams


def decode(**body: Any) -> ResponsesRequest:
    return decode_responses_request(json.dumps({"input": "hi", **body}).encode())


def refused(param: str, **body: Any) -> str:
    with pytest.raises(RequestError) as info:
        req = decode(**body)
        req.check_refused()
        req.chat_tools()
        req.chat_tool_choice()
        input_messages(req.input)
        req.sampling_params()
    assert info.value.param == param, str(info.value)
    assert info.value.status == 400
    return str(info.value)


# -- input ----------------------------------------------------------------------------------------
def test_a_string_is_one_user_message() -> None:
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]


def test_message_items_in_every_form() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "input_text", "text": "Use French."}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        # An output message of an earlier response, sent back as it came.
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Salut", "annotations": [], "logprobs": []}],
        },
        {"role": "assistant", "content": "plain"},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use French."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Salut"},
        {"role": "assistant", "content": "plain"},
    ]


def test_function_calls_become_tool_calls_and_tool_messages() -> None:
    items = [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}', "id": "fc_2"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}, "id": "c1"}
    assert input_messages(items) == [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call, {**call, "id": "c2", "function": {"name": "weather", "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_one_turns_items_make_one_assistant_message() -> None:
    """What a response outputs (reasoning, message, calls) sent back is one assistant turn."""
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {}}}
    assert input_messages(items) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Hmm.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [{**call, "id": "c2"}]},
    ]


def test_function_tools_in_chats_shape() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    req = decode(
        tools=[tool, {"type": "function", "name": "g", "parameters": None}],
        tool_choice={"type": "function", "name": "g"},
    )
    req.check_refused()
    [f, g] = req.chat_tools() or []
    assert (f.function.name, f.function.description, f.function.parameters, f.function.strict) == (
        "f",
        "d",
        {"type": "object"},
        True,
    )
    assert (g.function.name, g.function.parameters) == ("g", None)
    choice = req.chat_tool_choice()
    assert not isinstance(choice, str) and choice is not None and choice.function.name == "g"
    assert decode(tool_choice="required").chat_tool_choice() == "required"


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([], "input"),
        (["hi"], "input[0]"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": "x", "name": "bob"}], "input[0].name"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "output_text", "text": "x"}]}], "input[0].content[0].type"),
        ([{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 3}]}], "input[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}], "input[0].arguments"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}], "input[0].arguments"),
        ([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}], "input[0].encrypted_content"),
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}], "input[0].summary"),
        (
            [{"type": "reasoning", "summary": [], "content": [{"type": "input_text", "text": "x"}]}],
            "input[0].content[0].type",
        ),
    ],
)
def test_bad_input_items_name_their_place(items: list[Any], param: str) -> None:
    with pytest.raises(RequestError) as info:
        input_messages(items)
    assert info.value.param == param, str(info.value)


# -- text.format → structured outputs ------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
        ({"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}, StructuredOutputsParams(json=SCHEMA)),
        ({"type": "json_schema", "name": "a", "schema": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ],
)
def test_text_format_maps_to_structured_outputs(fmt: Any, expected: Any) -> None:
    req = decode(text={} if fmt is None else {"format": fmt})
    req.check_refused()
    params = req.sampling_params()
    assert params.structured_outputs == expected
    assert req.text_config()["format"] == (fmt or {"type": "text"})


def test_sampling_fields_and_defaults() -> None:
    params = decode(temperature=0.5, top_p=0.9, max_output_tokens=7).sampling_params({"temperature": 0.1, "top_k": 5})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 5, 7)
    params = decode().sampling_params({"temperature": 0.1, "max_tokens": 9, "seed": 3})
    assert (params.temperature, params.max_tokens, params.seed) == (0.1, 9, None)
    assert decode(max_output_tokens=50).sampling_params({"max_tokens": 9}).max_tokens == 9
    assert decode().sampling_params().max_tokens is None  # up to the context
    req = decode(include=["message.output_text.logprobs"], top_logprobs=3)
    req.check_refused()
    assert req.sampling_params().logprobs == 3
    assert decode(include=["message.output_text.logprobs"]).sampling_params().logprobs == 0
    assert decode().sampling_params().logprobs is None


def test_accepted_fields_pass() -> None:
    req = decode(
        model="m",
        instructions="x",
        store=False,
        previous_response_id="resp_1",
        metadata={"k": "v"},
        user="u",
        parallel_tool_calls=False,
        truncation="disabled",
        tool_choice="none",
        tools=[],
        background=False,
        service_tier="auto",
        stream=True,
        stream_options={"include_obfuscation": False},
        text={"format": {"type": "text"}, "verbosity": "medium"},
        reasoning={"effort": None, "summary": None},
    )
    req.check_refused()


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_field(name: str) -> None:
    assert name in refused(name, **{name: "x"})


@pytest.mark.parametrize(
    ("param", "body"),
    [
        ("reasoning.effort", {"reasoning": {"effort": "low"}}),
        ("reasoning.summary", {"reasoning": {"summary": "auto"}}),
        ("reasoning.generate_summary", {"reasoning": {"generate_summary": "concise"}}),
        ("reasoning.budget", {"reasoning": {"budget": 3}}),
        ("background", {"background": True}),
        ("truncation", {"truncation": "auto"}),
        ("service_tier", {"service_tier": "flex"}),
        ("stream_options", {"stream_options": {"include_obfuscation": False}}),
        ("stream_options.include_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}}),
        ("include", {"include": ["reasoning.encrypted_content"]}),
        ("top_logprobs", {"top_logprobs": 2}),
        ("text.verbosity", {"text": {"verbosity": "low"}}),
        ("text.format.type", {"text": {"format": {"type": "grammar"}}}),
        (
            "text.format.description",
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "description": "d"}}},
        ),
        ("text.format.name", {"text": {"format": {"type": "json_schema", "schema": {}}}}),
        ("text.format.strict", {"text": {"format": {"type": "json_object", "strict": True}}}),
        ("tools[0].type", {"tools": [{"type": "web_search"}]}),
        ("tools[1].type", {"tools": [{"type": "function", "name": "f"}, "f"]}),
        ("tools[0].name", {"tools": [{"type": "function", "parameters": {}}]}),
        ("tools[0].function", {"tools": [{"type": "function", "name": "f", "function": {}}]}),
        ("tool_choice.type", {"tool_choice": {"type": "mcp", "server_label": "x"}}),
        ("tool_choice.function", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ("metadata", {"metadata": {f"k{i}": "v" for i in range(17)}}),
        ("metadata", {"metadata": {"k": "v" * 513}}),
        ("temperature", {"temperature": -1}),
        ("top_p", {"top_p": 0}),
        ("max_output_tokens", {"max_output_tokens": 0}),
        ("frequency_penalty", {"frequency_penalty": 1}),
        ("text.format.extra", {"text": {"format": {"type": "text", "extra": 1}}}),
        ("input", {"input": None}),
    ],
)
def test_refusals_name_their_field(param: str, body: dict[str, Any]) -> None:
    refused(param, **body)


def test_max_output_tokens_beyond_the_context() -> None:
    with pytest.raises(RequestError) as info:
        decode(max_output_tokens=1000).check_max_tokens(512)
    assert info.value.param == "max_output_tokens"


def test_the_response_object_reads_as_the_sdk_type() -> None:
    """The encoded object is what the official SDK's `Response` model validates."""
    from openai.types.responses import Response

    from sonar.http.responses_protocol import (
        IncompleteDetails,
        InputTokensDetails,
        Logprob,
        OutputMessage,
        OutputText,
        OutputTokensDetails,
        ResponseUsage,
        TopLogprob,
    )

    logprob = Logprob("Hi", -0.5, [72, 105], [TopLogprob("Hi", -0.5, [72, 105])])
    obj = ResponseObject(
        id="resp_1",
        model="m",
        status="incomplete",
        output=[OutputMessage("msg_1", "incomplete", [OutputText("Hi", [], [logprob])])],
        incomplete_details=IncompleteDetails("max_output_tokens"),
        metadata={"k": "v"},
        usage=ResponseUsage(5, 1, 6, InputTokensDetails(2), OutputTokensDetails()),
    )
    parsed = Response.model_validate(msgspec.to_builtins(obj))
    assert parsed.output_text == "Hi" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.usage.input_tokens_details.cached_tokens == 2
    assert parsed.usage.input_tokens_details.cache_write_tokens == 0


def test_input_images_become_the_image_token_and_their_urls() -> None:
    """Each input_image part is the model's image token where it was; its URL is kept with the
    message (`IMAGES`, for a later turn) and collected with the part's place (for the errors)."""
    urls: list[tuple[str, str]] = []
    items = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "compare"},
                {"type": "input_image", "image_url": "data:a", "detail": "auto"},
                {"type": "input_image", "image_url": "file:///b.png"},
            ],
        },
    ]
    messages = input_messages(items, image_token="<image>", images=urls)
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "compare\n<image>\n<image>", IMAGES: ["data:a", "file:///b.png"]},
    ]
    assert urls == [("data:a", "input[1].content[1].image_url"), ("file:///b.png", "input[1].content[2].image_url")]


@pytest.mark.parametrize(
    ("part", "param", "says"),
    [
        ({"type": "input_image", "image_url": "data:a", "detail": "high"}, "detail", "only 'auto'"),
        ({"type": "input_image", "file_id": "file-1", "detail": "auto"}, "file_id", "no Files API"),
        ({"type": "input_image", "detail": "auto"}, "image_url", "needs its image_url"),
        ({"type": "input_image", "image_url": "data:a", "size": 3}, "size", "not a known field"),
    ],
)
def test_bad_input_images_name_their_field(part: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(RequestError) as info:
        input_messages([{"role": "user", "content": [part]}], image_token="<image>")
    assert info.value.param == f"input[0].content[0].{param}" and says in str(info.value)
