"""`cache_salt` and `--max-logprobs -1` through a real `python -m sonar serve`.

* `cache_salt` keeps tenants apart in the prefix cache: the same long prompt under another salt
  reports `usage.prompt_tokens_details.cached_tokens == 0` (nothing shared, so nothing to probe),
  under the same salt it reports cached tokens; no salt is a namespace of its own. Completions and
  chat, whole and streamed. A salt that is not a non-empty string of bounded length is a 400
  naming `cache_salt`.
* `--max-logprobs -1` is no cap: a completion may ask for more than the default 20 logprobs, up
  to the vocabulary.

The package's plain server serves the module (tests/http/conftest.py: with
`--enable-prompt-tokens-details`, which reports the cached tokens, and `--max-logprobs -1`); each
test's prompts are its own.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sonar.core.request import MAX_CACHE_SALT_LENGTH
from tests.http.conftest import ServerProcess, sse_events

#: Several 16-token blocks long, so a repeat can be served from the prefix cache.
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Within fifty years"
)


@pytest.fixture(scope="module")
def http(plain_server: ServerProcess) -> Any:
    with httpx.Client(base_url=plain_server.base_url, timeout=60) as client:
        yield client


def complete(http: httpx.Client, salt: str | None = None, prompt: str = LONG_PROMPT, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_completions_share_the_prefix_cache_only_under_the_same_salt(http: httpx.Client) -> None:
    prompt = "Tenant isolation, completions. " + LONG_PROMPT
    first = complete(http, "tenant-a", prompt)
    assert cached(first) == 0 and first["usage"]["prompt_tokens"] > 32
    assert cached(complete(http, "tenant-b", prompt)) == 0  # another tenant learns nothing
    assert cached(complete(http, None, prompt)) == 0  # nor does an unsalted request
    again = complete(http, "tenant-a", prompt)
    assert cached(again) >= 32 and cached(again) % 16 == 0  # the tenant itself is served from the cache
    assert cached(complete(http, "tenant-b", prompt)) >= 32
    assert cached(complete(http, None, prompt)) >= 32  # the unsalted namespace, as without salts
    # The salt changes the cache key only, never the output.
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_chat_and_streams_honour_the_salt(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Tenant isolation, chat. " + LONG_PROMPT}]

    def chat(salt: str) -> int:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200, r.text
        return cached(r.json())

    def streamed_chat(salt: str) -> int:
        body = {
            "messages": messages,
            "max_tokens": 2,
            "cache_salt": salt,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        return cached(events[-2])

    def streamed_completion(salt: str) -> int:
        body = {
            "prompt": "Tenant isolation, streamed. " + LONG_PROMPT,
            "max_tokens": 2,
            "cache_salt": salt,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
        return cached(events[-2])

    for run in (chat, streamed_chat, streamed_completion):
        assert run(f"{run.__name__}-1") == 0
        assert run(f"{run.__name__}-2") == 0
        assert run(f"{run.__name__}-1") >= 32, run.__name__


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_LENGTH + 1), 42, ["a"]])
def test_an_invalid_salt_is_a_400_naming_it(http: httpx.Client, salt: Any) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}),
    ):
        r = http.post(path, json={**body, "cache_salt": salt})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt", r.text
    assert complete(http, "x" * MAX_CACHE_SALT_LENGTH, "Hello")["choices"]  # the longest salt allowed


def test_max_logprobs_minus_one_is_no_cap(http: httpx.Client) -> None:
    body = complete(http, prompt="The capital of France is", max_tokens=2, logprobs=60)
    top = body["choices"][0]["logprobs"]["top_logprobs"]
    # 60 alternatives per position (as text: tokens that decode alike share a key)
    assert len(top) == 2 and all(40 <= len(position) <= 61 for position in top), [len(p) for p in top]
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert "vocabulary" in r.json()["error"]["message"], r.text
    schema = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["logprobs"]
    assert schema["anyOf"][0]["maximum"] == 49152, schema  # the vocabulary's size, not -1
