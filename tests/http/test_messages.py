"""Chat messages and tools as the chat template receives them: the shapes (pure, then rendered by
the real tokenizer's `apply_chat_template`), the 400s, and over a real `python -m sonar serve`
with a template that renders tools, tool calls and an extra variable: /tokenize shows the prompt,
--default-chat-template-kwargs and a request's chat_template_kwargs reach it, and
--exclude-tools-when-tool-choice-none keeps the tools out of a chat request's prompt (seen in the
request log)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgspec
import pytest

from sonar.http.messages import template_messages, template_tools, tool_choice_of
from sonar.http.protocol import ChatMessage, ChatTool, NamedToolChoice, RequestError
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly

MODEL = "smol"

#: Renders what a tool-calling template reads: tools, tool calls (arguments iterated as a dict),
#: tool_call_id, reasoning_content and an extra variable.
TEMPLATE = (
    "{% if greeting is defined %}[greeting:{{ greeting }}]{% endif %}"
    "{% for t in tools or [] %}[tool:{{ t.function.name }}:{{ t.function.parameters | tojson }}]{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.reasoning_content %}[thought:{{ m.reasoning_content }}]{% endif %}"
    "{% for c in m.tool_calls or [] %}[call:{{ c.id }}:{{ c.function.name }}:"
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}]{% endfor %}"
    "{% if m.tool_call_id %}[answers:{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATION = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "I should look it up.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def decoded(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    return msgspec.convert(raw, list[ChatMessage])


# -- the shapes -----------------------------------------------------------------------------------
def test_messages_take_the_shapes_transformers_templates_read():
    assert template_messages(decoded(CONVERSATION)) == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in\nParis?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should look it up.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]
    # A template that knows the developer role gets it as sent.
    [developer] = template_messages(decoded(CONVERSATION[:1]), "{% if m.role == 'developer' %}")
    assert developer["role"] == "developer"
    tools = template_tools(msgspec.convert([WEATHER], list[ChatTool]))
    assert tools == [WEATHER]  # unset fields left out, not null


BAD = [
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    (
        [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
        "messages[0].tool_calls",
    ),
    (
        [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{'a': 1}"}}]}],
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}],
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        [
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}}],
            }
        ],
        "messages[0].tool_calls[0].type",
    ),
    ([{"role": "assistant", "content": "x", "refusal": "no"}], "messages[0].refusal"),
    ([], "messages"),
]


@pytest.mark.parametrize("raw, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_a_wrong_message_is_a_400_naming_it(raw: list[dict[str, Any]], param: str):
    with pytest.raises(RequestError) as info:
        template_messages(decoded(raw))
    assert info.value.param == param and info.value.status == 400


def test_a_response_message_sent_back_passes():
    back = {"role": "assistant", "content": "Blue.", "refusal": None, "annotations": [], "audio": None}
    assert template_messages(decoded([back])) == [{"role": "assistant", "content": "Blue."}]


def test_tool_choice_is_checked_against_the_tools():
    tools = msgspec.convert([WEATHER], list[ChatTool])
    named = msgspec.convert({"type": "function", "function": {"name": "get_weather"}}, NamedToolChoice)
    assert tool_choice_of(None, None) == "none" and tool_choice_of(None, tools) == "auto"
    assert tool_choice_of("auto", None) == "none"  # nothing to call
    assert tool_choice_of("none", tools) == "none" and tool_choice_of("required", tools) == "required"
    assert tool_choice_of(named, tools) is named
    for choice, given, param in [
        ("required", None, "tool_choice"),
        ("any", tools, "tool_choice"),
        (named, None, "tool_choice"),
        (msgspec.convert({"function": {"name": "get_time"}}, NamedToolChoice), tools, "tool_choice.function.name"),
        (
            msgspec.convert({"type": "x", "function": {"name": "get_weather"}}, NamedToolChoice),
            tools,
            "tool_choice.type",
        ),
    ]:
        with pytest.raises(RequestError) as info:
            tool_choice_of(choice, given)
        assert info.value.param == param
    with pytest.raises(RequestError) as info:
        template_tools(msgspec.convert([WEATHER, WEATHER], list[ChatTool]))
    assert info.value.param == "tools[1].function.name"


# -- over a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("messages")
    template = Path(tmp / "tools.jinja")
    template.write_text(TEMPLATE)
    srv = start_server(
        tmp,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "32M",
        "--served-model-name",
        MODEL,
        "--chat-template",
        str(template),
        "--default-chat-template-kwargs",
        json.dumps({"greeting": "Ahoy"}),
        "--exclude-tools-when-tool-choice-none",
        "--enable-log-requests",
        "--disable-uvicorn-access-log",
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def rendered(http: httpx.Client, **body: Any) -> str:
    r = http.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return http.post("/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]}).json()["prompt"]


def test_tools_and_template_kwargs_reach_the_template(http):
    text = rendered(http, messages=CONVERSATION, tools=[WEATHER])
    assert text.startswith("[greeting:Ahoy][tool:get_weather:")
    assert "[call:call_1:get_weather:city=Paris;]" in text and "[answers:call_1]" in text
    assert "<|im_start|>system\nAnswer briefly." in text
    # The request's kwargs win over --default-chat-template-kwargs.
    assert rendered(http, messages=CONVERSATION, chat_template_kwargs={"greeting": "Hej"}).startswith("[greeting:Hej]")
    for body, param in [
        ({"messages": CONVERSATION, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"prompt": "x", "tools": [WEATHER]}, "tools"),
    ]:
        r = http.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_conversation_with_tool_calls_is_served_and_tool_choice_none_leaves_the_tools_out(server, http):
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": CONVERSATION, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["id"]
    deadline = time.monotonic() + 5
    while request_id not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    [line] = [x for x in server.log().splitlines() if request_id in x and "request.received" in x]
    assert "[greeting:Ahoy]" in line and "[call:call_1:get_weather:city=Paris;]" in line
    assert "[tool:get_weather" not in line  # --exclude-tools-when-tool-choice-none
    # auto (the default with tools) needs a tool-call parser, which this server was not given.
    for choice in (None, "auto"):
        body = {"model": MODEL, "messages": CONVERSATION, "tools": [WEATHER], "max_tokens": 2}
        r = http.post("/v1/chat/completions", json=body if choice is None else {**body, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
