"""What the chaos tests share: a fleet of concurrent streaming requests, the server's tree and metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

#: The engine flags every chaos server runs with: float32 (greedy outputs repeatable), a small
#: KV cache, the model length the prompts need.
ENGINE_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "256",
    "--seed",
    "0",
    "--served-model-name",
    "smol",
)

PROMPTS = [f"Question {i}: name a colour, a fruit and a city, then explain why in one sentence." for i in range(32)]


@dataclass
class StreamResult:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None
    status: int = 0
    events: list[Any] = field(default_factory=list)


async def stream_completion(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, on_chunk: Callable[[], Awaitable[None]] | None = None
) -> StreamResult:
    """One greedy streamed completion; the text put together from its chunks."""
    body = {
        "model": "smol",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    result = StreamResult()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = json.loads(await response.aread())
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = event
                continue
            if event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                result.text += choice.get("text", "")
                result.chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                if on_chunk is not None:
                    await on_chunk()
    return result


async def stream_fleet(
    base_url: str,
    prompts: list[str],
    max_tokens: int,
    on_chunk: Callable[[int], Awaitable[None]] | None = None,
    timeout: float = 180.0,
) -> list[StreamResult]:
    """All prompts streamed at once; `on_chunk(total chunks so far)` after each chunk."""
    results: list[StreamResult | None] = [None] * len(prompts)
    seen = 0

    async def tick() -> None:
        nonlocal seen
        seen += 1
        if on_chunk is not None:
            await on_chunk(seen)

    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def one(i: int) -> None:
            results[i] = await stream_completion(client, prompts[i], max_tokens, tick)

        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    return results  # type: ignore[return-value]


def actor(base_url: str, name: str) -> dict[str, Any]:
    """The node called `name` in the server's live tree (`/actors`)."""
    tree = httpx.get(f"{base_url}/actors", timeout=10).json()

    def walk(node: dict[str, Any]) -> Any:
        if node["name"] == name:
            return node
        for child in node.get("children", []):
            found = walk(child)
            if found is not None:
                return found
        return None

    found = walk(tree)
    assert found is not None, f"no actor {name!r} in {tree}"
    return found


def metrics(base_url: str, timeout: float = 10) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` parsed by prometheus_client: {(sample name, sorted labels): value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=timeout).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out
