"""Structured outputs and forced tool calls after the thinking, over HTTP (`sonar serve
--reasoning-parser`), on the real SmolLM2.

As in tests/engine/test_structured_reasoning.py, an assistant message "<think>\\nI will answer"
continued puts the model mid-thought, and a plugin's reasoning parser (`dot_thinking`) ends the
thinking at ".": the server constrains what follows it, `reasoning_content` carries the thinking
and `content` (or `tool_calls`) the constrained answer, whole and streamed alike.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.engine.test_structured_reasoning import QUESTION, SCHEMA, THINKING, THOUGHT, write_plugin
from tests.http.conftest import start_server, stop_server_cleanly

PERSON_TOOL = {
    "type": "function",
    "function": {"name": "record_person", "description": "Record a person.", "parameters": SCHEMA},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("structured_reasoning")
    srv = start_server(
        tmp,
        *("--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--seed", "0"),
        *("--reasoning-parser-plugin", write_plugin(tmp), "--reasoning-parser", "dot_thinking"),
    )
    yield srv
    stop_server_cleanly(srv)


def chat(server: Any, messages: list[dict[str, str]], **body: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "temperature": 0,
            "max_tokens": 40,
            **body,
        },
        timeout=120,
    )


def streamed(server: Any, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
    """The stream's deltas of choice 0 put together: reasoning_content, content, tool call pieces."""
    got: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": {}, "finish_reason": None}
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={
            "messages": messages,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "temperature": 0,
            "max_tokens": 40,
            "stream": True,
            **body,
        },
        timeout=120,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                got["reasoning_content"] += delta.get("reasoning_content") or ""
                got["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    name, args = got["calls"].get(call["index"], ("", ""))
                    function = call.get("function") or {}
                    got["calls"][call["index"]] = (
                        name + (function.get("name") or ""),
                        args + (function.get("arguments") or ""),
                    )
                got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]
    return got


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_reasoning_content_is_the_thinking_and_content_the_json(server: Any) -> None:
    r = chat(server, THINKING, response_format=JSON_SCHEMA)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "your question"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    stream = streamed(server, THINKING, response_format=JSON_SCHEMA)
    assert (stream["reasoning_content"], stream["content"]) == (message["reasoning_content"], message["content"])
    assert stream["finish_reason"] == "stop"


def test_a_prompt_that_ended_the_thinking_answers_json_and_no_reasoning(server: Any) -> None:
    r = chat(server, THOUGHT, structured_outputs={"json": SCHEMA})
    message = r.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    stream = streamed(server, THOUGHT, structured_outputs={"json": SCHEMA})
    assert (stream["reasoning_content"], stream["content"]) == ("", message["content"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "record_person"}}])
def test_forced_tool_calls_come_after_the_thinking(server: Any, tool_choice: Any) -> None:
    r = chat(server, THINKING, tools=[PERSON_TOOL], tool_choice=tool_choice, max_tokens=60)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    message = choice["message"]
    assert message["reasoning_content"] == "your question" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "record_person"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    assert choice["finish_reason"] == "tool_calls"
    stream = streamed(server, THINKING, tools=[PERSON_TOOL], tool_choice=tool_choice, max_tokens=60)
    assert stream["reasoning_content"] == "your question"
    assert stream["calls"] == {0: (call["function"]["name"], call["function"]["arguments"])}


def test_thinking_cut_by_max_tokens_has_no_content(server: Any) -> None:
    r = chat(server, [QUESTION, THINKING[1]], response_format=JSON_SCHEMA, max_tokens=2)
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "your question" and not choice["message"]["content"]
