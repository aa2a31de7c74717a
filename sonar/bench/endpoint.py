"""One request to an OpenAI-compatible server, streamed and timed token by token (or answered
whole, `stream` false: then only its whole latency is seen).

Backends: ``openai`` posts to ``/v1/completions`` (``choices[0].text``), ``openai-chat`` to
``/v1/chat/completions`` (``choices[0].delta.content``). Both stream with
``stream_options.include_usage``, greedy, and take the output length from the final ``usage``
chunk when the server sends one (else the number of text chunks). A chunk with text is one token
arrival: the first sets the time to first token, each later one adds an inter-token latency.
A request answered whole has its first token, and all others, when the answer comes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sonar.bench.datasets import SampleRequest

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """The timing of one request (seconds, `start` and `token_times` on the perf_counter clock)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    streamed: bool = True
    """False: answered whole; `ttft` is then the whole latency."""


def request_body(
    backend: str,
    model: str,
    sample: SampleRequest,
    ignore_eos: bool,
    extra: dict[str, Any] | None = None,
    stream: bool = True,
) -> dict[str, Any]:
    """The JSON body for `sample`: the fields the reference benchmark client sends."""
    if backend == "openai":
        body: dict[str, Any] = {"model": model, "prompt": sample.prompt, "max_tokens": sample.expected_output_len}
    elif backend == "openai-chat":
        body = {
            "model": model,
            "messages": [{"role": "user", "content": sample.prompt}],
            "max_completion_tokens": sample.expected_output_len,
        }
    else:
        raise ValueError(f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)})")
    body["temperature"] = 0.0
    if stream:
        body.update({"stream": True, "stream_options": {"include_usage": True}})
    if ignore_eos:
        body["ignore_eos"] = True
    if sample.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": sample.json_schema},
        }
    body.update(extra or {})
    return body


def headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    backend: str,
    model: str,
    sample: SampleRequest,
    ignore_eos: bool,
    extra: dict[str, Any] | None = None,
    stream: bool = True,
) -> RequestResult:
    """Send one request and time it; a failure is recorded in the result, never raised."""
    if not stream:
        return await _send_whole(client, url, backend, request_body(backend, model, sample, ignore_eos, extra, False))
    chat = backend == "openai-chat"
    result = RequestResult(prompt_len=sample.prompt_len)
    body = request_body(backend, model, sample, ignore_eos, extra)
    usage_tokens: int | None = None
    pieces: list[str] = []
    first_chunk: float | None = None  # the first chunk with a choice, text or not
    start = result.start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers()) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"])[:500]
                    return result
                now = time.perf_counter()
                if choices := data.get("choices"):
                    first_chunk = now if first_chunk is None else first_chunk
                    piece = (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")
                    if piece:
                        if not result.token_times:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.token_times.append(now)
                        pieces.append(piece)
                if usage := data.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    if usage.get("prompt_tokens"):
                        result.prompt_len = int(usage["prompt_tokens"])
        result.text = "".join(pieces)
        result.output_tokens = int(usage_tokens) if usage_tokens is not None else len(result.token_times)
        # Tokens that all decode to no text (special tokens, skipped) still came: the request's
        # first token is then its first chunk, as the reference client counts it.
        if not result.token_times and first_chunk is not None and result.output_tokens > 0:
            result.ttft = first_chunk - start
            result.success = True
        else:
            result.success = bool(result.token_times)
        if not result.success:
            result.error = "the stream carried no token"
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency = time.perf_counter() - start
    return result


async def _send_whole(client: httpx.AsyncClient, url: str, backend: str, body: dict[str, Any]) -> RequestResult:
    """A request answered whole: its output length from ``usage``, every token at its end."""
    result = RequestResult(streamed=False)
    start = result.start = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers())
        end = time.perf_counter()
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:500]}"
            return result
        data = response.json()
        choice = data["choices"][0]
        result.text = (choice["message"]["content"] or "") if backend == "openai-chat" else choice["text"]
        result.prompt_len = int(data["usage"]["prompt_tokens"])
        result.output_tokens = int(data["usage"]["completion_tokens"])
        result.ttft = end - start
        result.token_times = [end] * result.output_tokens
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "the answer carried no token"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency = time.perf_counter() - start
    return result
