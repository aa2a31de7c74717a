"""The OpenAI API of a real `python -m sonar serve`, through the official `openai` SDK and httpx.

One server serves the whole module (starting one costs seconds). It runs with `--api-key`, so
every client here sends the key; the 401 tests leave it out or send a wrong one.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.http.conftest import ServerProcess, sse_events, start_server, stop_server

MODEL = "smol"
API_KEY = "sonar-test-key"
MAX_MODEL_LEN = 256
STORY = "Once upon a time, in a small village by the sea,"
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Within fifty years"
)


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
        "--seed",
        "0",
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
    )
    yield srv
    code = stop_server(srv)
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{srv.log()[-4000:]}"
    assert "sonar serve: stopped" in srv.out()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def tokenize(http: httpx.Client, **body: Any) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def expect_error(
    response: httpx.Response, status: int, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    """The OpenAI error body; its `code` is the status unless OpenAI's `code` is given."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and error["code"] == (status if code is None else code)
    if param is not None:
        assert error["param"] == param, error
    return error


# -- completions ----------------------------------------------------------------------------------
def test_completion_text_and_token_id_prompts_give_the_same_text_and_exact_usage(client, http):
    ids = tokenize(http, prompt=STORY)
    text = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text.object == "text_completion" and text.model == MODEL and text.id.startswith("cmpl-")
    [choice] = text.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert (text.usage.prompt_tokens, text.usage.completion_tokens, text.usage.total_tokens) == (
        len(ids),
        8,
        len(ids) + 8,
    )
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == choice.text
    assert by_ids.usage == text.usage
    # Several prompts at once: one choice each, in order; prompt tokens counted once per prompt.
    many = client.completions.create(
        model=MODEL, prompt=[STORY, "Water boils at"], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == choice.text[: len(many.choices[0].text)]
    assert many.usage.prompt_tokens == len(ids) + len(tokenize(http, prompt="Water boils at"))
    assert many.usage.completion_tokens == 8


def test_n_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt=STORY, max_tokens=6, temperature=0.9, seed=1234, n=2, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].text != first.choices[1].text
    assert first.usage.completion_tokens == 12
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    # Token ids: n=2 of two prompts numbers the choices prompt-major.
    two = client.completions.create(**{**kw, "prompt": [[504, 3458], [504, 3458]], "max_tokens": 2})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text for c in two.choices[:2]] == [c.text for c in two.choices[2:]]


def test_stop_string_ends_the_text_before_it(client):
    full = (
        client.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    words = full.split()
    stop = next(w for w in words[2:] if len(w) > 2)
    cut = full.index(stop)
    hit = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert hit.choices[0].text == full[:cut]
    assert hit.choices[0].finish_reason == "stop"


def test_logprobs_and_echo_on_a_token_id_prompt(client, http):
    out = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the top one

    ids = tokenize(http, prompt=STORY)
    echo = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=1, echo=True, extra_body={"ignore_eos": True}
    )
    choice = echo.choices[0]
    prompt_text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert choice.text == prompt_text + out.choices[0].text
    elp = choice.logprobs
    assert len(elp.tokens) == len(ids) + 5
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in elp.token_logprobs[1:])
    assert "".join(elp.tokens) == choice.text
    assert elp.token_logprobs[len(ids) :] == pytest.approx(lp.token_logprobs, abs=2e-3)
    assert echo.usage.prompt_tokens == len(ids) and echo.usage.completion_tokens == 5


def test_streamed_completion_matches_the_whole_one(client):
    whole = client.completions.create(
        model=MODEL, prompt=STORY, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=STORY,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


# -- chat -----------------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
]


def test_chat_non_streamed_and_streamed_with_usage(client, http):
    prompt_ids = tokenize(http, messages=MESSAGES)
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    n = whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.total_tokens == len(prompt_ids) + n
    assert 1 <= n <= 10
    assert len(choice.logprobs.content) == n
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_chat_stream_ends_with_done_and_n_gets_a_role_chunk_per_choice(server, http):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "stream": True,
        "ignore_eos": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    roles = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    ends = sorted(e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"])
    assert ends == [0, 1]


def test_client_disconnect_mid_stream_aborts_the_request(server, http):
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[len("data: ") :])["id"]
    deadline = time.monotonic() + 10
    while "request.disconnected" not in server.log() or rid not in server.log():
        assert time.monotonic() < deadline, "the server did not notice the disconnect"
        time.sleep(0.1)
    # The engine is free again: a short request is answered at once.
    quick = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert quick.status_code == 200


# -- errors ---------------------------------------------------------------------------------------
def test_bad_parameters_are_400_naming_the_param(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=STORY, temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"
    expect_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": STORY, "max_tokens": "many"}), 400, "max_tokens"
    )
    expect_error(http.post("/v1/completions", json={"model": MODEL, "prompt": STORY, "top_p": 1.5}), 400, "top_p")
    expect_error(http.post("/v1/completions", json={"model": MODEL, "prompt": STORY, "n": 0}), 400, "n")
    expect_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    expect_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1.5]}), 400, "prompt")
    expect_error(
        http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "top_logprobs": 50, "logprobs": True}
        ),
        400,
        "top_logprobs",
    )
    expect_error(
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}),
        400,
        "max_completion_tokens",
    )
    expect_error(
        http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
        ),
        400,
        "messages[0].content",
    )
    # Unknown fields are refused, by their path.
    error = expect_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": STORY, "max_tokens": 1, "no_such_field": 1}),
        400,
        "no_such_field",
    )
    assert "unknown field 'no_such_field'" in error["message"]
    expect_error(
        http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{**MESSAGES[0], "mood": "happy"}]}),
        400,
        "messages[0].mood",
    )


def test_prompt_too_long_is_400_in_openais_words(client, http):
    long = "word " * (MAX_MODEL_LEN + 20)
    n = len(tokenize(http, prompt=long))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long, max_tokens=4)
    assert info.value.body["param"] == "prompt" and info.value.code == "context_length_exceeded"
    assert info.value.body["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {n + 4} tokens "
        f"({n} in the messages, 4 in the completion). Please reduce the length of the messages or completion."
    )
    # Streamed too: the error comes before the stream starts, as a 400.
    r = http.post(
        "/v1/chat/completions", json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": long}]}
    )
    error = expect_error(r, 400, "prompt", "context_length_exceeded")
    assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")


def test_malformed_json_is_400(http):
    expect_error(
        http.post(
            "/v1/completions", content=b'{"model": "smol", "prompt": ', headers={"content-type": "application/json"}
        ),
        400,
    )
    expect_error(http.post("/v1/chat/completions", content=b"not json"), 400)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=STORY, max_tokens=1)
    assert info.value.status_code == 404
    assert info.value.body["type"] == "NotFoundError" and "no-such-model" in info.value.body["message"]


def test_api_key_is_required_on_v1(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.get(f"{server.base_url}/v1/models", headers=headers)
        expect_error(r, 401)
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open, as in vLLM


# -- other endpoints ------------------------------------------------------------------------------
def test_models_health_version_ping(server, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "sonar"
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/nope").status_code == 404


def test_tokenize_detokenize_round_trip(http):
    text = "Hello world! 中文 🌍"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert len(r["token_strs"]) == r["count"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": text}
    expect_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > r["count"]


def test_user_without_the_request_log_is_refused(client):
    """`user` is metadata whose one effect is the request log, which this server does not write."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, user="alice")
    assert info.value.body["param"] == "user" and "--enable-log-requests" in info.value.body["message"]


def test_model_card_by_id(client, http):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "sonar")
    assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and "gpt-4o" in info.value.body["message"]
    expect_error(http.get("/v1/models/org/name"), 404, "model", "model_not_found")


def test_echo_with_max_tokens_0_scores_the_prompt(client, http):
    ids = tokenize(http, prompt=STORY)
    scored = client.completions.create(model=MODEL, prompt=STORY, max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == STORY and choice.finish_reason == "length"
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == STORY and lp.text_offset[0] == 0
    # The same scores as the prompt part of an echo that generates.
    full = client.completions.create(model=MODEL, prompt=STORY, max_tokens=2, echo=True, logprobs=1, temperature=0)
    assert full.choices[0].logprobs.token_logprobs[: len(ids)] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # Streamed: one text, the prompt; no completion tokens.
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": STORY,
            "max_tokens": 0,
            "echo": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = [e for e in sse_events(r) if e != "[DONE]"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == STORY
    assert events[-1]["usage"]["completion_tokens"] == 0
    # Without echo, max_tokens 0 asks for nothing: a 400.
    expect_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": STORY, "max_tokens": 0}), 400, "max_tokens"
    )
