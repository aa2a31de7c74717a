"""Tool calls and reasoning in chat completions (`sonar.http.tools`).

The plans, schemas and conversions run as plain values; the real server (SmolLM2) then shows
tool_choice "auto" parsing its output with `--tool-call-parser hermes` and thinking going to
`reasoning_content` with `--reasoning-parser qwen3`, whole and streamed, the streams reassembled
by the openai SDK's own accumulator. A chat template that renders the messages' text as it is
lets a few-shot prompt make the small model write a `<tool_call>` (or `<think>`) deterministically.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from sonar.http.protocol import ChatCompletionRequest, RequestError, decode_request
from sonar.http.settings import ServerSettings
from sonar.http.tools import ChoiceOutput, choice_output, finish_reason, plan_tools, whole_message
from sonar.sampling_params import SamplingParams, StructuredOutputsParams
from tests.http.conftest import start_server, stop_server_cleanly

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
AUTO = ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser="hermes")
PLAIN = ServerSettings(("m",))


def request(**body: Any) -> ChatCompletionRequest:
    return decode_request(
        json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode(), ChatCompletionRequest
    )


def refused(settings: ServerSettings, **body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        plan_tools(request(**body), settings)
    return info.value


# -- plans ----------------------------------------------------------------------------------------
def test_tool_choice_defaults() -> None:
    assert plan_tools(request(), PLAIN).mode == "none"
    assert plan_tools(request(tools=[WEATHER]), AUTO).mode == "auto"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), PLAIN).mode == "none"


def test_auto_needs_the_server_flags() -> None:
    error = refused(PLAIN, tools=[WEATHER])
    assert error.param == "tool_choice" and "--enable-auto-tool-choice" in str(error)
    assert refused(PLAIN, tools=[WEATHER], tool_choice="auto").param == "tool_choice"


def test_wrong_tool_choices_are_refused_naming_the_field() -> None:
    # The tools themselves (names, types) are checked by `template_tools`: tests/http/test_messages.py.
    wrong = refused(AUTO, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "not in tools (get_weather)" in str(wrong) and wrong.param == "tool_choice.function.name"
    assert refused(AUTO, tools=[WEATHER], tool_choice="sometimes").param == "tool_choice"
    assert refused(AUTO, tool_choice="required").param == "tool_choice"
    assert refused(PLAIN, tools=[WEATHER]).param == "tool_choice"  # auto without a parser


def constrained(settings: ServerSettings, params: SamplingParams | None = None, **body: Any) -> SamplingParams:
    params = params or SamplingParams()
    req = request(**body)
    plan_tools(req, settings).constrain(params, req.skip_special_tokens)
    return params


def test_forced_tool_choices_set_structured_outputs() -> None:
    params = constrained(PLAIN, tools=[WEATHER, TIME], tool_choice="required")
    assert params.structured_outputs is not None and params.structured_outputs.kind == "json"
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = constrained(PLAIN, tools=[WEATHER], tool_choice=named)
    assert params.structured_outputs is not None and params.structured_outputs.json == WEATHER["function"]["parameters"]
    assert constrained(PLAIN, tools=[WEATHER], tool_choice="none").structured_outputs is None
    assert constrained(AUTO, tools=[WEATHER]).structured_outputs is None


def test_forced_calls_and_another_constraint_are_refused() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(RequestError) as info:
        constrained(PLAIN, params, tools=[WEATHER], tool_choice="required")
    assert info.value.param == "tool_choice"


def test_a_parser_of_special_tokens_keeps_them() -> None:
    mistral = ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser="mistral")
    assert constrained(mistral, tools=[WEATHER]).skip_special_tokens is False
    assert constrained(mistral, tools=[WEATHER], skip_special_tokens=True).skip_special_tokens is True
    assert constrained(AUTO, tools=[WEATHER]).skip_special_tokens is True


# -- the schemas of forced calls, checked with jsonschema -----------------------------------------
def test_required_schema_accepts_calls_and_only_calls() -> None:
    schema = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), PLAIN).schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "get_time", "parameters": {}}],
        [{"name": "get_time", "parameters": {"zone": "CET"}}],
    ]
    bad = [
        [],
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "extra": 1}}],
        [{"name": "launch", "parameters": {}}],
        [{"name": "get_time"}],
    ]
    for value in good:
        jsonschema.validate(value, schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_parallel_tool_calls_false_allows_exactly_one() -> None:
    schema = plan_tools(
        request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), PLAIN
    ).schema()
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)


def test_named_schema_is_the_functions_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = plan_tools(request(tools=[WEATHER, TIME], tool_choice=named), PLAIN).schema()
    jsonschema.validate({"city": "Paris", "days": 3}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"days": 3}, schema)
    any_object = plan_tools(
        request(tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}), PLAIN
    ).schema()
    assert any_object == {"type": "object"}


# -- outputs: whole messages and the deltas the openai SDK reassembles ----------------------------
def chunks_of(output: ChoiceOutput, pieces: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    """The chunks chat.py sends for these text deltas (the role first, the reason with the last)."""
    chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        piece = output.step(text, last)
        delta = msgspec.to_builtins(output.delta(piece))
        chunks.append(
            {"index": 0, "delta": delta, "finish_reason": finish_reason(reason, output.calls_made) if last else None}
        )
    return [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [c]} for c in chunks]


def reassembled(chunks: list[dict[str, Any]]) -> Any:
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion().choices[0]


def both_ways(plan_body: dict[str, Any], text: str, settings: ServerSettings = AUTO, tail: str = "") -> Any:
    """The whole message of `text`, after checking the SDK reassembles the same from its stream."""
    plan = plan_tools(request(**plan_body), settings)
    whole = whole_message(choice_output(plan, settings, tail), text, "assistant")
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)] or [""]
    choice = reassembled(chunks_of(choice_output(plan, settings, tail), pieces))
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert got == [(c.function.name, c.function.arguments) for c in whole.tool_calls or []]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
    # The role's chunk carries content "" (as vLLM's), so a stream of calls only adds up to "".
    assert (choice.message.content or None) == whole.content
    assert getattr(choice.message, "reasoning_content", None) == whole.reasoning_content
    assert choice.finish_reason == ("tool_calls" if whole.tool_calls else "stop")
    return whole


def test_required_output_becomes_tool_calls() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    message = both_ways({"tools": [WEATHER, TIME], "tool_choice": "required"}, text, PLAIN)
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_named_output_becomes_one_call() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    message = both_ways({"tools": [WEATHER], "tool_choice": named}, ' {"city": "Lima", "days": 2} ', PLAIN)
    assert message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Lima", "days": 2}')
    ]


def test_auto_with_thinking_first() -> None:
    settings = ServerSettings(("m",), enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    text = (
        "<think>\nThe user wants the weather; I have a tool. <tool_call> is how I call it.\n</think>\n\n"
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    message = both_ways({"tools": [WEATHER]}, text, settings)
    assert message.reasoning_content == message.reasoning
    assert message.reasoning_content.startswith("\nThe user wants the weather")
    assert message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_auto_without_calls_is_content_and_stops() -> None:
    message = both_ways({"tools": [WEATHER]}, "It is sunny in Paris.")
    assert message.content == "It is sunny in Paris." and message.tool_calls is None


# -- the real server ------------------------------------------------------------------------------
TEMPLATE = "{%- for m in messages -%}{{ m.content }}{%- endfor -%}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FEW_SHOT_CALL = f"Q: weather in Paris?\nA: {CALL}\nQ: weather in Paris?\nA: {CALL}\nQ: weather in Paris?\nA:"
FEW_SHOT_THINK = (
    "Q: hello\nA: <think>They greet me.</think> Hello there!\n"
    "Q: hello\nA: <think>They greet me.</think> Hello there!\n"
    "Q: hello\nA:"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("tools")
    template = tmp / "raw.jinja"
    template.write_text(TEMPLATE)
    srv = start_server(
        tmp,
        *("--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--seed", "0"),
        *("--chat-template", str(template)),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"),
    )
    yield srv
    stop_server_cleanly(srv)


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def ask(server: Any, content: str, **kw: Any) -> Any:
    return client(server).chat.completions.create(
        model=server_model(server),
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=40,
        stop=["\nQ:"],
        **kw,
    )


def server_model(server: Any) -> str:
    return httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]


def test_auto_parses_the_models_tool_call(server: Any) -> None:
    completion = ask(server, FEW_SHOT_CALL, tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_auto_stream_reassembles_to_the_whole_result(server: Any) -> None:
    whole = ask(server, FEW_SHOT_CALL, tools=[WEATHER]).choices[0]
    stream = ask(server, FEW_SHOT_CALL, tools=[WEATHER], stream=True)
    state = ChatCompletionStreamState()
    names, pieces = [], 0
    for chunk in stream:
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:  # the first delta of a call: id, type, name
                    assert call.type == "function" and call.function.name and call.index == len(names)
                    names.append(call.function.name)
                else:  # then only pieces of the arguments
                    assert call.type is None and call.function.name is None and call.function.arguments
                    pieces += 1
    streamed = state.get_final_completion().choices[0]
    assert names == ["get_weather"] and pieces > 1  # the name once, the arguments in pieces
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert (streamed.message.content or None) == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_every_choice_of_n_is_parsed(server: Any) -> None:
    whole = ask(server, FEW_SHOT_CALL, tools=[WEATHER], n=2)
    state = ChatCompletionStreamState()
    for chunk in ask(server, FEW_SHOT_CALL, tools=[WEATHER], n=2, stream=True):
        state.handle_chunk(chunk)
    for choices in (whole.choices, state.get_final_completion().choices):
        assert [c.finish_reason for c in choices] == ["tool_calls", "tool_calls"]
        assert [[t.function.name for t in c.message.tool_calls] for c in choices] == [["get_weather"]] * 2


def test_thinking_goes_to_reasoning_content_whole_and_streamed(server: Any) -> None:
    whole = ask(server, FEW_SHOT_THINK).choices[0]
    raw = whole.message.model_dump()
    assert raw["reasoning_content"] == raw["reasoning"] == "They greet me."
    assert whole.message.content == "Hello there!" and whole.finish_reason == "stop"
    pieces: dict[str, str] = {"reasoning_content": "", "content": ""}
    for chunk in ask(server, FEW_SHOT_THINK, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for key in pieces:
                pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": "They greet me.", "content": "Hello there!"}


def test_plain_chat_is_unchanged_without_tools(server: Any) -> None:
    choice = ask(server, "Q: hello\nA: Hi!\nQ: hello\nA:").choices[0]
    assert choice.message.content.startswith("Hi!") and choice.message.tool_calls is None
    assert choice.message.model_dump().get("reasoning_content") is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choices_call_a_tool_with_valid_arguments(server: Any, choice: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Lima?"}],
        "tools": [WEATHER],
        "tool_choice": choice,
        "max_tokens": 96,
        "temperature": 0,
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice_out = r.json()["choices"][0]
    # The server runs --reasoning-parser qwen3, whose models may skip thinking: SmolLM2 has no
    # <think> token, so its first token is the grammar's (it does not wait for a </think>).
    assert choice_out["finish_reason"] == "tool_calls" and choice_out["message"].get("reasoning_content") is None
    calls = choice_out["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * len(calls) and calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    # Streamed, the deltas reassemble (as the openai SDK does it) to the same calls.
    state = ChatCompletionStreamState()
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                state.handle_chunk(ChatCompletionChunk.model_validate_json(line[len("data: ") :]))
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls or []] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ]


def test_forced_tool_choices_without_parallel_calls_make_exactly_one(server: Any) -> None:
    parameters = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        choice_ = (
            client(server)
            .chat.completions.create(
                model=server_model(server),
                messages=[{"role": "user", "content": "weather?"}],
                tools=[WEATHER],
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=0,
                max_tokens=120,
            )
            .choices[0]
        )
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        [call] = choice_.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_tool_choice_errors_over_http(server: Any) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "launch"}},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"
