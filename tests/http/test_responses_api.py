"""The Responses API of a real `python -m sonar serve`, through the official `openai` SDK and httpx.

One server serves the module, with a small response store (--max-stored-responses 3,
--max-stored-response-bytes 8000) so that eviction shows in a few requests, and tool_choice
"auto" (--enable-auto-tool-choice, the hermes parser). SmolLM2 at temperature 0 is
deterministic: a response must say what the chat completion of the same conversation says. A
second server parses thinking (--reasoning-parser, which the first must not have: it refuses
output logprobs), has no tool_choice "auto", and its worker fails mid-stream on one token.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.http.conftest import ServerProcess, serving, start_server, stop_server_cleanly

MODEL = "smol"
MAX_MODEL_LEN = 512
MAX_STORED = 3
MAX_STORED_BYTES = 8000
NAME_TURN = "My name is Zorblax."
QUESTION = "What is my name?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = start_server(
        tmp_path_factory.mktemp("server"),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-gpu-blocks-override",
        "96",
        "--served-model-name",
        MODEL,
        "--max-stored-responses",
        str(MAX_STORED),
        "--max-stored-response-bytes",
        str(MAX_STORED_BYTES),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def input_tokens(http: httpx.Client, messages: list[dict[str, str]]) -> int:
    """The prompt length of `messages` rendered by the chat template, as /tokenize counts it."""
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def expect_error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    return error["message"]


def create(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 30, **kw})


# -- one response ---------------------------------------------------------------------------------
def test_a_response_in_openai_shape_says_what_the_chat_says(client, http):
    instructions = "Answer in one short sentence."
    question = "What is the capital of France?"
    r = create(client, input=question, instructions=instructions, metadata={"run": "1"}, user="u-1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [item] = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.status == "completed"
    [part] = item.content
    assert part.type == "output_text" and part.annotations == [] and part.text
    assert r.output_text == part.text  # the SDK's convenience property
    assert (r.instructions, r.metadata, r.user, r.previous_response_id) == (instructions, {"run": "1"}, "u-1", None)
    assert (r.temperature, r.max_output_tokens, r.truncation, r.store) == (0.0, 30, "disabled", True)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    assert r.usage.input_tokens == input_tokens(http, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > r.usage.input_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # Full prompt blocks (16 tokens) either came from the prefix cache or were computed into it.
    details = r.usage.input_tokens_details
    assert details.cached_tokens + details.cache_write_tokens == r.usage.input_tokens // 16 * 16
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    assert chat.choices[0].message.content == r.output_text
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_the_token_limit_makes_an_incomplete_response(client):
    r = create(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 3 and r.output_text


def test_input_items_and_logprobs(client, http):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
    ]
    r = create(client, input=items, include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6)
    # developer speaks as the system.
    assert r.usage.input_tokens == input_tokens(
        http, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    )
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    assert "".join(lp.token for lp in logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    # Streamed, each delta carries its tokens' logprobs; the done events carry them all.
    kw = dict(input=items, include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=6, stream=True)
    events = list(create(client, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    # (A prefix-cache hit computes the prompt in other chunks: the same numbers up to rounding.)
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-3)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]


# -- streaming ------------------------------------------------------------------------------------
def test_stream_events_in_order_reassemble_to_the_non_stream_text(client):
    question = "Name three colors."
    whole = create(client, input=question, max_output_tokens=40)
    events = list(create(client, input=question, max_output_tokens=40, stream=True))
    types = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert types[:4] == head and types[-4:] == tail
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id == events[4].item_id
    # Streamed responses are kept too.
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_the_sdk_stream_helper_reads_the_events(client):
    with client.responses.stream(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=60) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas


def test_the_sse_lines_name_each_event_and_end_without_done(http):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert all(line.startswith("event: ") for line in lines[0::2])
    assert names == [d["type"] for d in datas] and names[-1] == "response.incomplete"
    assert "[DONE]" not in "".join(lines)


def test_a_refused_stream_is_a_plain_400(http):
    body = {"model": MODEL, "input": "Hi", "stream": True, "reasoning": {"effort": "low"}}
    expect_error(http.post("/v1/responses", json=body), 400, "reasoning.effort")


# -- conversations --------------------------------------------------------------------------------
def test_previous_response_id_continues_the_conversation(client, http):
    first = create(client, input=NAME_TURN)
    second = create(client, input=QUESTION, previous_response_id=first.id)
    assert "Zorblax" in second.output_text and second.previous_response_id == first.id
    # Without the history the model does not know the name.
    assert "Zorblax" not in create(client, input=QUESTION).output_text
    # The prompt is the first turn and its answer, then the question.
    history = [
        {"role": "user", "content": NAME_TURN},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": QUESTION},
    ]
    assert second.usage.input_tokens == input_tokens(http, history)
    # The same conversation sent whole, the first output item as it came back, answers the same.
    again = create(client, input=[history[0], *first.output, history[2]])
    assert again.output_text == second.output_text and again.usage.input_tokens == second.usage.input_tokens
    # A turn's instructions come first in its prompt, and are not carried over to the next turn.
    third = create(client, input="Say it again.", previous_response_id=second.id, instructions="Be brief.")
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Say it again."}]
    assert third.usage.input_tokens == input_tokens(http, [{"role": "system", "content": "Be brief."}, *history])
    fourth = create(client, input="Thanks.", previous_response_id=third.id, max_output_tokens=2)
    history += [{"role": "assistant", "content": third.output_text}, {"role": "user", "content": "Thanks."}]
    assert fourth.usage.input_tokens == input_tokens(http, history) and fourth.instructions is None


def test_store_false_keeps_nothing(client, http):
    r = create(client, input="Hi", store=False, max_output_tokens=2)
    assert r.store is False
    expect_error(http.get(f"/v1/responses/{r.id}"), 404, "response_id")
    body = {"model": MODEL, "input": "Hi", "previous_response_id": r.id}
    assert "not found" in expect_error(http.post("/v1/responses", json=body), 400, "previous_response_id")


def test_the_oldest_responses_are_evicted_past_the_count(client, http):
    ids = [create(client, input=f"Count {i}", max_output_tokens=1).id for i in range(MAX_STORED + 1)]
    expect_error(http.get(f"/v1/responses/{ids[0]}"), 404, "response_id")
    for rid in ids[1:]:
        assert http.get(f"/v1/responses/{rid}").json()["id"] == rid
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=QUESTION, previous_response_id=ids[0])
    assert info.value.body["param"] == "previous_response_id" and "evicted" in info.value.body["message"]


def test_the_oldest_responses_are_evicted_past_the_bytes(client, http):
    """Small responses take ~1.3 KB each; 12 metadata values of 500 characters make one of ~7.4
    KB, which fits the 8000-byte bound only alone; 16 of 512 make one that never fits."""
    small = [create(client, input=f"Bytes {i}", max_output_tokens=1).id for i in range(2)]
    big = create(client, input="Big", max_output_tokens=1, metadata={f"k{i}": "v" * 500 for i in range(12)}).id
    for rid in small:
        expect_error(http.get(f"/v1/responses/{rid}"), 404, "response_id")
    assert http.get(f"/v1/responses/{big}").status_code == 200
    huge = create(client, input="Huge", max_output_tokens=1, metadata={f"k{i}": "v" * 512 for i in range(16)}).id
    expect_error(http.get(f"/v1/responses/{huge}"), 404, "response_id")
    assert http.get(f"/v1/responses/{big}").status_code == 200  # nothing was evicted for it


def test_retrieve_delete_and_cancel(client, http):
    r = create(client, input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    expect_error(http.get(f"/v1/responses/{r.id}", params={"stream": "true"}), 400, "stream")
    expect_error(http.post(f"/v1/responses/{r.id}/cancel"), 400, "response_id")
    assert http.delete(f"/v1/responses/{r.id}").json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    expect_error(http.delete(f"/v1/responses/{r.id}"), 404, "response_id")
    expect_error(http.post(f"/v1/responses/{r.id}/cancel"), 404, "response_id")


# -- function tools -------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
TIME = {"type": "function", "name": "get_time", "parameters": None, "strict": False}  # any object
NAMED = {"type": "function", "name": "get_weather"}
WEATHER_QUESTION = "What is the weather in Paris?"


def calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choices_give_calls_with_valid_arguments(client, choice):
    kw = dict(input=WEATHER_QUESTION, tools=[WEATHER, TIME], tool_choice=choice, max_output_tokens=150)
    r = create(client, parallel_tool_calls=False, **kw)
    assert r.status == "completed" and not r.parallel_tool_calls
    assert (r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump()) == choice
    [call] = r.output  # one call, no message
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name in ("get_weather", "get_time")
    assert call.name == "get_weather" or choice == "required"
    schema = {"get_weather": WEATHER["parameters"], "get_time": {"type": "object"}}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    # Several calls are allowed by default; each is an item.
    many = create(client, **kw)
    assert many.status == "completed" and many.output == calls(many) and calls(many)
    for c in calls(many):
        jsonschema.validate(json.loads(c.arguments), {"get_weather": WEATHER["parameters"]}.get(c.name, {}))


def test_streamed_calls_reassemble_to_the_whole_response(client):
    kw = dict(model=MODEL, input=WEATHER_QUESTION, tools=[WEATHER], tool_choice=NAMED, temperature=0)
    whole = client.responses.create(max_output_tokens=150, **kw)
    with client.responses.stream(max_output_tokens=150, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
    ]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added = events[2].item
    assert (added.type, added.name, added.arguments, added.status) == (
        "function_call",
        "get_weather",
        "",
        "in_progress",
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and events[-3].arguments == "".join(deltas)
    assert events[-2].item.status == "completed" and events[-2].item.call_id == added.call_id
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def shape(items: list[Any]) -> list[Any]:
        return [(i.type, i.name, i.arguments, i.status) for i in items]

    assert shape(final.output) == shape(whole.output)
    assert final.output[0].parsed_arguments == json.loads(whole.output[0].arguments)  # the SDK parses strict ones


def test_a_tool_round_trip_through_previous_response_id(client, http):
    first = create(client, input=WEATHER_QUESTION, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=150)
    [call] = calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}
    kw = dict(tools=[WEATHER], tool_choice="none", max_output_tokens=20)
    second = create(client, input=[result], previous_response_id=first.id, **kw)
    assert second.status in ("completed", "incomplete") and [i.type for i in second.output] == ["message"]
    # The prompt is chat's: the call as the assistant's tool_calls, its output as a tool message.
    messages = [
        {"role": "user", "content": WEATHER_QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees."},
    ]
    r = http.post("/tokenize", json={"messages": messages, "tools": [CHAT_WEATHER]})
    assert r.status_code == 200, r.text
    assert second.usage.input_tokens == r.json()["count"]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CHAT_WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    assert chat.choices[0].message.content == second.output_text
    # The items sent back whole make the same prompt and answer.
    again = create(client, input=[{"role": "user", "content": WEATHER_QUESTION}, *first.output, result], **kw)
    assert again.usage.input_tokens == second.usage.input_tokens and again.output_text == second.output_text


# -- tool_choice "auto" and reasoning, parsed ----------------------------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>They greet me.</think> Hello there!"


def few_shot(answer: str, question: str) -> list[dict[str, str]]:
    """Two turns that answer `question` with `answer`, then the question again: SmolLM2 at
    temperature 0 answers it the same way."""
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}] * 2
    return [*turns, {"role": "user", "content": question}]


def test_auto_parses_the_models_call_whole_and_streamed(client):
    kw = dict(model=MODEL, input=few_shot(CALL, WEATHER_QUESTION), tools=[WEATHER], temperature=0)
    whole = client.responses.create(max_output_tokens=40, **kw)
    assert whole.status == "completed" and whole.tool_choice == "auto"
    [call] = whole.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        {"city": "Paris"},
        "completed",
    )
    with client.responses.stream(max_output_tokens=40, **kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" not in types  # the call's markup never shows as text
    assert [(i.type, i.name, i.arguments) for i in final.output] == [(call.type, call.name, call.arguments)]
    # Without tools the same output is text.
    plain = client.responses.create(max_output_tokens=40, **{**kw, "tools": None})
    assert plain.output_text.startswith("<tool_call>")


def test_thinking_becomes_a_reasoning_item_whole_and_streamed(poisoned):
    client = openai.OpenAI(base_url=f"{poisoned.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=MODEL, input=few_shot(THOUGHT, "hello"), temperature=0, max_output_tokens=30)
    whole = client.responses.create(**kw)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "They greet me.")]
    assert message.type == "message" and whole.output_text == "Hello there!"
    assert whole.usage.output_tokens_details.reasoning_tokens == 4  # "They greet me."
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert thought == done.text == "They greet me."
    assert types.index("response.output_item.done") < types.index("response.output_text.delta")

    def shape(items: list[Any]) -> list[Any]:
        return [(i.type, i.status, [(c.type, c.text) for c in i.content]) for i in items]

    assert shape(final.output) == shape(whole.output)
    # The thinking goes back to the template with the turn (reasoning_content), as it does sent whole.
    after = client.responses.create(**{**kw, "input": "hello", "previous_response_id": whole.id})
    again = client.responses.create(
        **{**kw, "input": [*few_shot(THOUGHT, "hello"), *whole.output, {"role": "user", "content": "hello"}]}
    )
    assert after.usage.input_tokens == again.usage.input_tokens


# -- refusals -------------------------------------------------------------------------------------
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}
REFUSALS = [
    ("conversation", {"conversation": "conv_1"}),
    ("prompt", {"prompt": {"id": "pmpt_1"}}),
    ("max_tool_calls", {"max_tool_calls": 2}),
    ("prompt_cache_key", {"prompt_cache_key": "k"}),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}),
    ("prompt_cache_options", {"prompt_cache_options": {"mode": "explicit"}}),
    ("safety_identifier", {"safety_identifier": "s"}),
    ("context_management", {"context_management": [{"type": "compaction"}]}),
    ("image", {"image": {"context_compression": "auto"}}),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}),
    ("access_programs", {"access_programs": {"cyber": "standard"}}),
    ("background_options", {"background_options": {"completion_window": "2h"}}),
    ("reasoning.effort", {"reasoning": {"effort": "low"}}),
    ("reasoning.summary", {"reasoning": {"summary": "auto"}}),
    ("background", {"background": True}),
    ("truncation", {"truncation": "auto"}),
    ("service_tier", {"service_tier": "flex"}),
    ("stream_options.include_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}}),
    ("include", {"include": ["reasoning.encrypted_content"]}),
    ("top_logprobs", {"top_logprobs": 3}),
    ("text.verbosity", {"text": {"verbosity": "high"}}),
    ("text.format.type", {"text": {"format": {"type": "grammar"}}}),
    (
        "text.format.description",
        {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "description": "d"}}},
    ),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("tools[1].name", {"tools": [FUNCTION, FUNCTION], "tool_choice": "required"}),
    ("tools[0].parameter", {"tools": [{**FUNCTION, "parameter": {}}], "tool_choice": "required"}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tool_choice": {"type": "function", "name": "f"}}),
    ("tool_choice.name", {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}}),
    ("tool_choice.type", {"tools": [FUNCTION], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}),
    ("tool_choice", {"tools": [FUNCTION], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
    (
        "include",
        {"tools": [FUNCTION], "tool_choice": "required", "include": ["message.output_text.logprobs"]},
    ),
    ("input[0].type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}),
    ("input[0].arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}),
    ("input[0].summary", {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}),
    ("input[0].content[0].type", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    ("input[0].role", {"input": [{"role": "tool", "content": "x"}]}),
    ("metadata", {"metadata": {f"k{i}": "v" for i in range(17)}}),
    ("max_output_tokens", {"max_output_tokens": MAX_MODEL_LEN + 1}),
    ("seed", {"seed": 1}),
    ("input", {"input": []}),
    ("model", {"model": "gpt-5"}),
]


@pytest.mark.parametrize(("param", "body"), REFUSALS, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSALS)])
def test_refused_fields_are_400s_naming_them(http, param, body):
    status = 404 if param == "model" else 400
    message = expect_error(http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body}), status, param)
    assert param.split(".")[-1].split("[")[0] in message or param in ("input", "model")


def test_auto_tool_choice_is_refused_without_enable_auto_tool_choice(poisoned):
    """tool_choice "auto", asked or the default with tools, on the server started without
    --enable-auto-tool-choice (the module's server has it)."""
    for body in ({"tools": [FUNCTION]}, {"tools": [FUNCTION], "tool_choice": "auto"}):
        r = httpx.post(f"{poisoned.base_url}/v1/responses", json={"model": MODEL, "input": "Hi", **body}, timeout=60)
        assert "--enable-auto-tool-choice" in expect_error(r, 400, "tool_choice")


# -- structured output ----------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
FORMATS = [
    ({"type": "json_object"}, {"type": "object"}, 'Reply with the JSON object {"ok": true}.'),
    ({"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}, PERSON, "Describe a person."),
]


@pytest.mark.parametrize(("fmt", "schema", "question"), FORMATS, ids=["json_object", "json_schema"])
def test_text_formats_give_json_that_validates(client, fmt, schema, question):
    kw = dict(input=question, text={"format": fmt}, max_output_tokens=120)
    whole = create(client, **kw)
    assert whole.status == "completed", whole.output_text
    jsonschema.validate(json.loads(whole.output_text), schema)
    assert whole.text.format.type == fmt["type"]
    events = list(create(client, stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text


def test_malformed_bodies_are_400s(http):
    expect_error(http.post("/v1/responses", content=b"{not json"), 400, None)
    expect_error(http.post("/v1/responses", json={"model": MODEL}), 400, "input")
    expect_error(http.post("/v1/responses", json={"model": MODEL, "input": 3}), 400, "input")


# -- a failure mid-stream -------------------------------------------------------------------------
#: " Paris" in SmolLM2's vocabulary: the answer to the question below says it, the question does not.
PARIS = 7042


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second server: thinking parsed (qwen3), no tool_choice "auto", and a worker that fails
    every step that computes " Paris" (a request that generates it is quarantined mid-stream)."""
    args = (
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "32",
        "--placement",
        "worker=inprocess",
        "--served-model-name",
        MODEL,
        "--reasoning-parser",
        "qwen3",
    )
    with serving(tmp_path_factory.mktemp("poisoned"), *args, "--fault-injection", f"raise@token={PARIS}") as srv:
        yield srv


def test_an_engine_failure_mid_stream_ends_with_response_failed(poisoned):
    client = openai.OpenAI(base_url=f"{poisoned.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(input="What is the capital of France?", temperature=0, max_output_tokens=20)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.endswith(" Paris")  # what was streamed before the step that failed
    failed = events[-1]
    assert failed.type == "response.failed" and failed.sequence_number == len(events) - 1
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert "quarantined" in failed.response.error.message
    assert failed.response.output[0].content[0].text == deltas
    # A failed response is not kept.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.response.id)
