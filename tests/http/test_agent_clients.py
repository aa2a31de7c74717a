"""What agent frameworks call, through their own clients against a real `python -m sonar serve`:
the openai SDK's `parse` helpers and tool calls, and langchain-openai's `with_structured_output`
(json_schema and function_calling) and `bind_tools`.

The model is the embedded SmolLM2-135M-Instruct: too small to choose tools well, so every test
asks for what structured outputs guarantee (a schema-valid object, a forced tool call with valid
arguments), never for what the model would decide by itself.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly

MODEL = "smol"


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "artist", "farmer"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = start_server(
        tmp_path_factory.mktemp("agents"),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "160",
        "--seed",
        "0",
        "--served-model-name",
        MODEL,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server: ServerProcess) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=96, max_retries=0
    )


def _assert_valid_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call came back"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_openai_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person who works as an engineer."}],
        response_format=Person,
        max_tokens=96,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


def test_openai_required_tool_choice_calls_a_tool_with_valid_arguments(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=128,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    _assert_valid_calls(choice.message.tool_calls or [], {"get_weather", "get_time"})


def test_openai_named_tool_stream_reassembles_to_the_non_stream_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo, please."}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    _assert_valid_calls(whole.message.tool_calls or [], {"get_weather"})
    assert len(whole.message.tool_calls or []) == 1
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls or []] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []
    ]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat: ChatOpenAI, method: str) -> None:
    structured = chat.with_structured_output(Person, method=method)
    person = structured.invoke("Invent a person who works as a farmer.")
    assert isinstance(person, Person)


def test_langchain_bind_tools_returns_tool_calls(chat: ChatOpenAI) -> None:
    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city."""
        return f"20 degrees {unit} in {city}"

    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("How warm is it in Rome?")
    assert isinstance(message, AIMessage)
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    args = message.tool_calls[0]["args"]
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    # The tool's answer goes back as a `tool` message; the model then answers in prose.
    reply = chat.bind_tools([get_weather]).invoke(
        ["How warm is it in Rome?", message, get_weather.invoke(message.tool_calls[0])]
    )
    assert isinstance(reply, AIMessage) and (reply.content or reply.tool_calls)
