"""Bad input against one real `python -m sonar serve`: every case gets a 4xx in the OpenAI error
shape (`{"error": {"message", "type", "param", "code"}}`), never a 5xx, never a hang; the
server keeps serving correct text to normal requests sent before, during and after the table.

What the server decides, and this file holds it to:

* Unknown fields are accepted and ignored (as vLLM does by default): a 200, the same text as
  without them. (Clients such as the openai SDK send fields an older server does not know.)
* A number out of its range is a 400 naming the parameter, whatever its size (`2**70` too);
  `max_tokens` above the model length is a 400 (it could never be honoured); `n` is at most 128
  and a request at most --max-completions-per-request completions (prompts x n, 256 by
  default): a bigger one would exhaust memory.
* The body is JSON text in UTF-8: malformed JSON, invalid UTF-8, a lone surrogate, a JSON
  array / number / string / null instead of an object: 400.
* Headers larger than --h11-max-incomplete-event-size never reach the app: h11 refuses them and
  uvicorn answers a plain-text 400 and closes the connection. More headers than
  --h11-max-header-count: 431 in the OpenAI error shape.

Each request has a short timeout: a case that hangs fails as a timeout.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.http.conftest import ServerProcess, start_server, stop_server, stop_server_cleanly, tls

MODEL = "smol"
MAX_MODEL_LEN = 128
MAX_LOGPROBS = 5
HEADER_LIMIT = 64 * 1024  # --h11-max-incomplete-event-size
MAX_HEADERS = 32  # --h11-max-header-count
API_KEY = "sk-sonar-chaos-7f3a9c1e5b"
WRONG_KEY = "sk-wrong-2d8e6b4a0c"
#: Seconds any one bad request may take (the huge-body cases tokenize a megabyte first).
TIMEOUT = 30.0
BIG = 2**70

GOOD_PROMPT = "The capital of France is"
GOOD = {"model": MODEL, "prompt": GOOD_PROMPT, "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
USER = [{"role": "user", "content": "Hi"}]

COMPLETIONS, CHAT_PATH, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
ALL_PATHS = (COMPLETIONS, CHAT_PATH, TOKENIZE, DETOKENIZE)


@dataclass
class Case:
    """One bad request: `body` is JSON-encoded unless it is bytes; the answer must be `status`
    (an OpenAI error) and, when `param` is set, name that parameter."""

    id: str
    path: str
    body: Any
    status: int = 400
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def _cmp(name: str, value: Any, param: str | None = None, status: int = 400, **extra: Any) -> Case:
    return Case(
        f"cmpl-{name}", COMPLETIONS, {**GOOD, name.split(":")[0]: value, **extra}, status, param or name.split(":")[0]
    )


def _chat(name: str, value: Any, param: str | None = None, status: int = 400, **extra: Any) -> Case:
    return Case(
        f"chat-{name}", CHAT_PATH, {**CHAT, name.split(":")[0]: value, **extra}, status, param or name.split(":")[0]
    )


# Wrong types and out-of-range values of every sampling field, on both generation endpoints.
SAMPLING_CASES: list[tuple[Any, ...]] = [
    ("max_tokens:neg", -1),
    ("max_tokens:zero", 0),
    ("max_tokens:big", BIG),
    ("max_tokens:over-context", 10**6),
    ("max_tokens:float", 1.5),
    ("max_tokens:str", "5"),
    ("max_tokens:bool", True),
    ("n:zero", 0),
    ("n:million", 10**6),
    ("n:big", BIG),
    ("n:float", 2.5),
    ("temperature:neg", -0.5),
    ("temperature:str", "hot"),
    ("temperature:list", [1]),
    ("top_p:zero", 0),
    ("top_p:over", 1.5),
    ("top_p:neg", -1),
    ("top_k:minus2", -2),
    ("top_k:big", BIG),
    ("top_k:float", 1.5),
    ("min_p:neg", -0.1),
    ("min_p:over", 1.1),
    ("presence_penalty:over", 2.5),
    ("presence_penalty:under", -3),
    ("frequency_penalty:over", 3),
    ("frequency_penalty:under", -2.01),
    ("repetition_penalty:zero", 0),
    ("repetition_penalty:neg", -1),
    ("seed:big", BIG),
    ("seed:u64", 2**64),
    ("seed:over-i64", 2**63),
    ("seed:under-i64", -(2**63) - 1),
    ("seed:str", "42"),
    ("min_tokens:neg", -1),
    ("min_tokens:big", BIG),
    ("min_tokens:over-max", 10),
    ("priority:big", BIG),
    ("priority:str", "high"),
    ("stop:empty", ""),
    ("stop:empty-in-list", ["a", ""]),
    ("stop:int", 5),
    ("stop:list-of-int", [1], "stop[0]"),
    ("stop_token_ids:neg", [-1], "stop_token_ids[0]"),
    ("stop_token_ids:big", [BIG], "stop_token_ids[0]"),
    ("stop_token_ids:oov", [10**6]),
    ("stop_token_ids:str", "1"),
    ("logit_bias:neg-id", {"-1": 1}),
    ("logit_bias:big-id", {str(BIG): 1}),
    ("logit_bias:oov", {"1000000": 1}),
    ("logit_bias:non-int-id", {"x": 1}),
    ("logit_bias:value", {"1": 101}),
    ("logit_bias:list", [1, 2]),
    ("stream:str", "yes"),
    ("stream_options:int", 5),
    ("stream_options:include_usage", {"include_usage": "y"}),
    ("ignore_eos:int", 1),
    ("user:int", 5),
    ("model:int", 5),
]

CASES: list[Case] = []
for _name, _value, *_param in SAMPLING_CASES:
    if _name == "stream_options:include_usage":
        _param = ["stream_options.include_usage"]
    CASES += [_cmp(_name, _value, *_param), _chat(_name, _value, *_param)]
CASES += [
    # Completions: prompts and the legacy fields.
    _cmp("prompt:empty-string", ""),
    _cmp("prompt:empty-list", []),
    _cmp("prompt:empty-inner-list", [[]]),
    _cmp("prompt:int", 5),
    _cmp("prompt:null", None),
    _cmp("prompt:object", {"text": "x"}),
    _cmp("prompt:mixed", [1, "a"]),
    _cmp("prompt:float-ids", [1.5]),
    _cmp("prompt:bool-ids", [True]),
    _cmp("prompt:neg-id", [-1]),
    _cmp("prompt:oov-id", [49152]),
    _cmp("prompt:huge-id", [BIG]),
    _cmp("prompt:oov-in-batch", [[1, 2], [10**9]]),
    _cmp("prompt:too-long-text", "hello " * (MAX_MODEL_LEN + 10)),
    _cmp("prompt:too-long-ids", list(range(1, MAX_MODEL_LEN + 2))),
    _cmp("prompt:too-many-prompts", ["a"] * 1025),
    _cmp("prompt:too-many-sequences", ["a"] * 20, n=128),
    _cmp("logprobs:over-cap", MAX_LOGPROBS + 1),
    _cmp("logprobs:neg", -1),
    _cmp("logprobs:big", BIG),
    _cmp("logprobs:bool", True),
    _cmp("echo:str", "yes"),
    _cmp("suffix:set", "x"),
    _cmp("best_of:other", 3),
    _cmp("best_of:big", BIG),
    Case("cmpl-missing-prompt", COMPLETIONS, {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    Case("cmpl-unknown-model", COMPLETIONS, {**GOOD, "model": "gpt-4"}, 404, "model"),
    Case("cmpl-stream-bad-param", COMPLETIONS, {**GOOD, "stream": True, "temperature": -1}, 400, "temperature"),
    Case("cmpl-stream-too-long", COMPLETIONS, {**GOOD, "stream": True, "prompt": list(range(1, 200))}, 400, "prompt"),
    Case("cmpl-stream-oov", COMPLETIONS, {**GOOD, "stream": True, "prompt": [10**6]}, 400, "prompt"),
    Case(
        "cmpl-stream-oov-in-batch", COMPLETIONS, {**GOOD, "stream": True, "prompt": [[1, 2], [3, 10**6]]}, 400, "prompt"
    ),
    # Chat: messages, roles, content parts, logprobs.
    _chat("messages:empty", []),
    _chat("messages:string", "hi"),
    _chat("messages:list-of-int", [5], "messages[0]"),
    _chat("messages:no-role", [{"content": "x"}], "messages[0]"),
    _chat("messages:int-role", [{"role": 5, "content": "x"}], "messages[0].role"),
    _chat("messages:int-content", [{"role": "user", "content": 5}], "messages[0].content"),
    _chat(
        "messages:image-part",
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        "messages[0].content",
    ),
    _chat("messages:text-part-without-text", [{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
    _chat("messages:part-not-object", [{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
    _chat("messages:too-long", [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 10)}], "prompt"),
    _chat("top_logprobs:over-20", 21),
    _chat("top_logprobs:neg", -1),
    _chat("top_logprobs:big", BIG),
    _chat("top_logprobs:without-logprobs", 2),
    _chat("top_logprobs:over-cap", MAX_LOGPROBS + 1, "logprobs", logprobs=True),
    _chat("logprobs:int", 5),
    _chat("max_completion_tokens:neg", -1),
    _chat("max_completion_tokens:big", BIG),
    _chat("max_completion_tokens:over-context", MAX_MODEL_LEN + 1),
    _chat("add_generation_prompt:str", "yes"),
    _chat("continue_final_message:with-generation-prompt", True, None),
    Case("chat-missing-messages", CHAT_PATH, {"model": MODEL}, 400, "messages"),
    Case("chat-unknown-model", CHAT_PATH, {**CHAT, "model": "gpt-4"}, 404, "model"),
    Case("chat-stream-bad-param", CHAT_PATH, {**CHAT, "stream": True, "top_p": 2}, 400, "top_p"),
    # /tokenize and /detokenize.
    Case("tok-empty", TOKENIZE, {}, 400, "prompt"),
    Case("tok-both", TOKENIZE, {"prompt": "a", "messages": USER}, 400, "prompt"),
    Case("tok-prompt-int", TOKENIZE, {"prompt": 5}, 400, "prompt"),
    Case("tok-messages-bad", TOKENIZE, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    Case("tok-messages-empty", TOKENIZE, {"messages": []}, 400),
    Case("tok-flag-type", TOKENIZE, {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    Case("tok-unknown-model", TOKENIZE, {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    Case("detok-missing", DETOKENIZE, {}, 400, "tokens"),
    Case("detok-str", DETOKENIZE, {"tokens": "1 2"}, 400, "tokens"),
    Case("detok-neg", DETOKENIZE, {"tokens": [-1]}, 400, "tokens[0]"),
    Case("detok-oov", DETOKENIZE, {"tokens": [49152]}, 400, "tokens"),
    Case("detok-big", DETOKENIZE, {"tokens": [BIG]}, 400, "tokens[0]"),
    Case("detok-float", DETOKENIZE, {"tokens": [1.5]}, 400, "tokens[0]"),
    Case("detok-unknown-model", DETOKENIZE, {"tokens": [1], "model": "gpt-4"}, 404, "model"),
    # Big bodies: a prompt far over the model length, as token ids and as text.
    Case("cmpl-huge-ids-body", COMPLETIONS, {**GOOD, "prompt": list(range(1, 1000)) * 400}, 400, "prompt"),
    Case("cmpl-huge-text-body", COMPLETIONS, {**GOOD, "prompt": "lorem ipsum " * 90_000}, 400, "prompt"),
    Case(
        "chat-huge-text-body",
        CHAT_PATH,
        {**CHAT, "messages": [{"role": "user", "content": "lorem " * 150_000}]},
        400,
        "prompt",
    ),
    # Bodies that are not a JSON object in UTF-8, on every endpoint.
    *[
        Case(f"{path}-{name}", path, raw, 400)
        for path in ALL_PATHS
        for name, raw in [
            ("truncated", b'{"prompt": "a"'),
            ("empty", b""),
            ("array", b"[]"),
            ("number", b"5"),
            ("string", b'"x"'),
            ("null", b"null"),
            ("nan", b'{"prompt": "a", "temperature": NaN}'),
            ("trailing", b'{"prompt": "a"} x'),
            ("invalid-utf8", b'{"prompt": "caf\xe9", "messages": [], "tokens": []}'),
            ("bom-utf16", b"\xff\xfe{\x00}\x00"),
            (
                "lone-surrogate",
                b'{"prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}], "tokens": "\\ud800"}',
            ),
            ("inf-number", b'{"prompt": 1e999, "messages": 1e999, "tokens": [1e999]}'),
            ("deep-nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ]
    ],
]
_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids)), [i for i in _ids if _ids.count(i) > 1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp("bad-input"),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "64M",
        "--seed",
        "0",
        "--served-model-name",
        MODEL,
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--h11-max-incomplete-event-size",
        str(HEADER_LIMIT),
        "--h11-max-header-count",
        str(MAX_HEADERS),
    )
    yield srv
    stop_server_cleanly(srv)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(http: httpx.Client) -> str:
    """The greedy text of GOOD before any bad request."""
    r = http.post(COMPLETIONS, json=GOOD)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert "Paris" in text
    return text


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {"content-type": "application/json", **case.headers}
    return http.post(case.path, content=case.content(), headers=headers)


def expect_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    if error["message"].startswith("This model's maximum context length is"):
        assert error["code"] == "context_length_exceeded", error  # what clients key on, as OpenAI
    else:
        assert error["code"] == status, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bad_input_gets_an_openai_4xx(http: httpx.Client, baseline: str, case: Case) -> None:
    expect_error(send(http, case), case.status, case.param)


def test_unknown_fields_are_refused_by_name(http: httpx.Client, baseline: str) -> None:
    extra = {"not_a_field": {"nested": [1, 2]}}
    for path, body in (
        (COMPLETIONS, GOOD),
        (CHAT_PATH, CHAT),
        (TOKENIZE, {"prompt": "a"}),
        (DETOKENIZE, {"tokens": [1]}),
    ):
        error = expect_error(http.post(path, json={**body, **extra}), 400, "not_a_field")
        assert "unknown field 'not_a_field'" in error["message"]
        # A declared field set to null is its default.
        r = http.post(path, json={**body, "model": None})
        assert r.status_code == 200, r.text
    expect_error(
        http.post(CHAT_PATH, json={**CHAT, "messages": [{"role": "user", "content": "Hi", "extra": 1}]}),
        400,
        "messages[0].extra",
    )
    r = http.post(COMPLETIONS, json={**GOOD, "response_format": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline, r.text


def test_routes_and_methods(http: httpx.Client) -> None:
    expect_error(http.get(COMPLETIONS), 405)
    expect_error(http.put(CHAT_PATH, json=CHAT), 405)
    expect_error(http.post("/v1/nope", json=GOOD), 404)
    expect_error(http.get("/v1/completions/../../etc/passwd"), 404)


def _raw(server: ServerProcess, request: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; what comes back until the server closes or goes quiet."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(request)
        except OSError:  # the server refused the rest and closed: still read what it answered
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
    return data


def test_oversized_header_is_refused_by_h11(server: ServerProcess, http: httpx.Client) -> None:
    body = json.dumps(GOOD).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Big: " + b"a" * (2 * HEADER_LIMIT) + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    started = time.monotonic()
    answer = _raw(server, request)
    assert time.monotonic() - started < 10
    # The app never sees the request: uvicorn answers h11's refusal, a plain 400, and closes.
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"connection: close" in answer.lower()
    # A header just under the limit is served.
    r = http.post(COMPLETIONS, json=GOOD, headers={"X-Big": "a" * (HEADER_LIMIT // 2)})
    assert r.status_code == 200, r.text


def test_too_many_headers_get_431(http: httpx.Client) -> None:
    many = {f"X-H{i}": "v" for i in range(MAX_HEADERS + 10)}
    expect_error(http.post(COMPLETIONS, json=GOOD, headers=many), 431)
    few = {f"X-H{i}": "v" for i in range(MAX_HEADERS - 10)}
    assert http.post(COMPLETIONS, json=GOOD, headers=few).status_code == 200


def test_bad_requests_alongside_normal_ones(server: ServerProcess, baseline: str) -> None:
    """The whole table again, concurrently with normal greedy requests (streamed and not) and a
    connection that stalls mid-body: the normal ones get the same text as alone."""
    host, port = server.base_url.removeprefix("http://").split(":")
    stalled = socket.create_connection((host, int(port)), timeout=10)
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": '
    )

    def normal(i: int) -> str:
        with httpx.Client(base_url=server.base_url, timeout=120, verify=tls()) as c:
            if i % 2:
                r = c.post(COMPLETIONS, json=GOOD)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
            text = ""
            with c.stream("POST", COMPLETIONS, json={**GOOD, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
            return text

    def bad(case: Case) -> tuple[str, int, str]:
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT, verify=tls()) as c:
            r = send(c, case)
            return case.id, r.status_code, r.text[:300]

    try:
        with ThreadPoolExecutor(8) as pool:
            normals = [pool.submit(normal, i) for i in range(6)]
            bads = [pool.submit(bad, c) for c in CASES]
            results = [f.result() for f in bads]
            texts = [f.result() for f in normals]
    finally:
        stalled.close()
    wrong = [(cid, status, text) for (cid, status, text), case in zip(results, CASES) if status != case.status]
    assert not wrong, wrong
    assert texts == [baseline] * len(texts)


def test_still_serving_after_the_table(http: httpx.Client, baseline: str) -> None:
    r = http.post(COMPLETIONS, json=GOOD)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline
    r = http.post(CHAT_PATH, json={**CHAT, "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert http.get("/health").status_code == 200
    load = http.get("/load").json()["server_load"]
    assert load == 0, load


# -- --api-key: constant-time comparison, keys never logged ---------------------------------------
def test_api_key_is_checked_and_never_logged(tmp_path: Path) -> None:
    srv = start_server(
        tmp_path,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "64M",
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--enable-log-requests",
        "--enable-log-outputs",
    )
    try:
        with httpx.Client(base_url=srv.base_url, timeout=TIMEOUT) as c:
            ok = {"Authorization": f"Bearer {API_KEY}"}
            r = c.post(COMPLETIONS, json=GOOD, headers=ok)
            assert r.status_code == 200, r.text
            with c.stream("POST", CHAT_PATH, json={**CHAT, "stream": True}, headers=ok) as s:
                assert s.status_code == 200 and "[DONE]" in s.read().decode()
            expect_error(c.post(COMPLETIONS, json={**GOOD, "temperature": -1}, headers=ok), 400, "temperature")
            for headers in (
                {},
                {"Authorization": f"Bearer {WRONG_KEY}"},
                {"Authorization": API_KEY},
                {"Authorization": f"Basic {API_KEY}"},
                {"Authorization": f"Bearer {API_KEY}x"},
                {"Authorization": f"Bearer {API_KEY[:-1]}"},
                {"Authorization": b"Bearer \xe9t\xe9"},
                {"X-Api-Key": API_KEY},
            ):
                error = expect_error(c.post(COMPLETIONS, json=GOOD, headers=headers), 401)
                assert API_KEY not in error["message"] and WRONG_KEY not in error["message"]
                expect_error(c.get("/v1/models", headers=headers), 401)
            # A key in the body is an unknown field, refused by its name: never logged either.
            c.post(COMPLETIONS, json={**GOOD, "api_key": WRONG_KEY}, headers=ok)
    finally:
        code = stop_server(srv)
    logs = srv.out() + srv.log()
    assert code == 0, logs[-4000:]
    assert "request.received" in logs  # request logging was on
    for secret in (API_KEY, WRONG_KEY, API_KEY[:-1]):
        assert secret not in logs, f"{secret!r} appears in the server's output"


def test_api_key_comparison_is_constant_time() -> None:
    """The middleware compares with `hmac.compare_digest`, against every key (no early exit)."""
    import inspect

    from sonar.http.app import ApiKeyMiddleware

    source = inspect.getsource(ApiKeyMiddleware.__call__)
    loop = source[source.index("for key") : source.index("if not ok")]
    assert "hmac.compare_digest" in loop and "break" not in loop and "return" not in loop
