"""Requests built to take the server down, against one real `python -m sonar serve` whose worker
crashes on every step that computes token 13 (`--fault-injection raise@token=13`, a stand-in for an
input that breaks the forward pass):

* temperature 1, `min_tokens` 1 and `stop_token_ids` covering the whole vocabulary leave the
  sampler nothing to draw: a 400 naming `stop_token_ids`, before it reaches the engine;
* a prompt holding token 13 crashes the worker, is run again alone, crashes it again and is
  quarantined: a 500 that says so, while the greedy requests beside it stream the text they
  stream alone;

and afterwards the server is healthy and serves, its engine never gave up.
"""

from __future__ import annotations

from typing import Iterator

import anyio
import httpx
import pytest

from tests.chaos.helpers import ENGINE_ARGS, PROMPTS, actor, stream_completion
from tests.http.conftest import ServerProcess, serving

POISON = 13
VOCAB_SIZE = 49152  # the embedded SmolLM2's
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serving(tmp_path_factory.mktemp("poison"), *ENGINE_ARGS, "--fault-injection", f"raise@token={POISON}") as srv:
        yield srv


@pytest.fixture(scope="module")
def alone(server: ServerProcess) -> list[str]:
    """Each greedy prompt's streamed text with nothing else running."""

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return [(await stream_completion(client, p, MAX_TOKENS)).text for p in PROMPTS[:3]]

    texts = anyio.run(run)
    assert all(texts)
    return texts


def healthy(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60,
        json={"model": "smol", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def beside(server: ServerProcess, hostile: dict, alone: list[str]) -> httpx.Response:
    """Send `hostile` while three greedy streams run; check their texts; return its response."""
    answer: list[httpx.Response] = []
    texts: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

        async def send() -> None:
            answer.append(await client.post("/v1/completions", json=hostile))

        async def greedy(i: int) -> None:
            result = await stream_completion(client, PROMPTS[i], MAX_TOKENS)
            assert result.status == 200 and result.error is None, result
            texts[i] = result.text

        with anyio.fail_after(150):
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(greedy, i)
                tg.start_soon(send)
    assert [texts[i] for i in range(3)] == alone
    return answer[0]


def test_a_full_vocabulary_stop_is_a_400_and_the_others_are_untouched(server: ServerProcess, alone: list[str]) -> None:
    hostile = {
        "model": "smol",
        "prompt": "Tell me a story",
        "max_tokens": 8,
        "temperature": 1,
        "min_tokens": 1,
        "stop_token_ids": list(range(VOCAB_SIZE)),
    }
    r = anyio.run(beside, server, hostile, alone)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop_token_ids" and error["code"] == 400
    healthy(server)
    assert actor(server.base_url, "worker")["restarts"] == 0


def test_a_poison_prompt_is_quarantined_and_the_others_finish_unchanged(
    server: ServerProcess, alone: list[str]
) -> None:
    before = actor(server.base_url, "worker")["restarts"]
    poisoned = [504, 3458, 314, POISON, 2030, 30]  # token ids, the poison among them
    hostile = {"model": "smol", "prompt": poisoned, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = anyio.run(beside, server, hostile, alone)
    assert r.status_code == 500, r.text
    assert "quarantine" in r.json()["error"]["message"].lower()
    assert 2 <= actor(server.base_url, "worker")["restarts"] - before <= 3
    healthy(server)
    log = server.out() + server.log()
    assert "request.quarantined" in log and log.count("injected fault in the forward pass") >= 2
