"""The request bodies `vllm bench serve` sends, against a real `python -m sonar serve`.

The benchmark client's `openai` backend posts to /v1/completions and its `openai-chat` backend
to /v1/chat/completions, always streamed with `stream_options.include_usage`, greedy
(temperature 0.0) and usually with `ignore_eos`, so that every request produces exactly the
asked-for number of tokens. It reads the response line by line: blank lines are skipped, the
`data: ` prefix is removed, `[DONE]` ends the stream, every other line is one JSON object. A
chunk with non-empty `choices` carries text (`choices[0].text`, or `choices[0].delta.content`
for chat); the chunk without choices carries `usage`, whose `completion_tokens` the benchmark
takes as the output length. It sends `Authorization: Bearer <OPENAI_API_KEY>`, which reads
`Bearer None` when that variable is unset; a server without --api-key must ignore it.

The bodies below are written from that client's documented behaviour, field by field:
completions: model, prompt (one string), temperature 0.0, repetition_penalty 1.0, max_tokens,
logprobs (null unless asked), stream true, stream_options {include_usage: true}, ignore_eos;
chat: model, messages [{role: user, content: [{type: text, text: ...}]}], temperature 0.0,
max_completion_tokens, stream true, stream_options {include_usage: true}, ignore_eos.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.http.conftest import ServerProcess

MODEL = "smol"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer None"}


@pytest.fixture(scope="module")
def server(plain_server: ServerProcess) -> ServerProcess:
    return plain_server


def read_like_bench(response: httpx.Response, chat: bool) -> tuple[str, int | None, list[dict[str, Any]]]:
    """Parse the stream the way the benchmark client does: (generated text, completion tokens, chunks)."""
    text, output_tokens, chunks, done = "", None, [], False
    for raw in response.iter_lines():
        line = raw.strip()
        if not line:
            continue
        assert not done, f"data after [DONE]: {line!r}"
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
            continue
        data = json.loads(payload)
        assert "error" not in data, data
        chunks.append(data)
        if choices := data.get("choices"):
            piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
            text += piece or ""
        elif usage := data.get("usage"):
            output_tokens = usage.get("completion_tokens")
    assert done, "the stream did not end with data: [DONE]"
    return text, output_tokens, chunks


def post(server: Any, path: str, body: dict[str, Any]) -> tuple[str, int | None, list[dict[str, Any]]]:
    with httpx.stream("POST", server.base_url + path, json=body, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return read_like_bench(response, chat=path.endswith("chat/completions"))


@pytest.mark.parametrize("max_tokens", [1, 24])
def test_openai_backend_completions(server: Any, max_tokens: int) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": max_tokens,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    text, output_tokens, chunks = post(server, "/v1/completions", body)
    assert text
    assert output_tokens == max_tokens
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > 0
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + max_tokens
    assert all(c["choices"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["model"] == MODEL and c["object"] == "text_completion" for c in chunks)


def test_openai_backend_older_body(server: Any) -> None:
    """Older clients also sent best_of 1 and ignore_eos false; the stream still reports usage."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0.0,
        "best_of": 1,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": False,
    }
    text, output_tokens, chunks = post(server, "/v1/completions", body)
    assert output_tokens is not None and 1 <= output_tokens <= 8
    assert chunks[-1]["choices"] == []


def test_openai_backend_greedy_is_repeatable(server: Any) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "temperature": 0.0,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    first, _, _ = post(server, "/v1/completions", body)
    second, _, _ = post(server, "/v1/completions", body)
    assert first == second


@pytest.mark.parametrize("content", ["parts", "string"])
def test_openai_chat_backend(server: Any, content: str) -> None:
    message = [{"type": "text", "text": PROMPT}] if content == "parts" else PROMPT
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": message}],
        "temperature": 0.0,
        "max_completion_tokens": 20,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    text, output_tokens, chunks = post(server, "/v1/chat/completions", body)
    assert text
    assert output_tokens == 20
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_parts_and_string_content_are_the_same_prompt(server: Any) -> None:
    def prompt_tokens(message: Any) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": message}],
            "temperature": 0.0,
            "max_completion_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        return post(server, "/v1/chat/completions", body)[2][-1]["usage"]["prompt_tokens"]

    assert prompt_tokens([{"type": "text", "text": PROMPT}]) == prompt_tokens(PROMPT)
