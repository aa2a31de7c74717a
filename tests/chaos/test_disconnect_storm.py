"""300 streaming requests, half of them cut off by their clients at random moments: the others
finish whole, and afterwards nothing is left behind — no request state in the frontend, the
scheduler or the detokenizer, and no KV block held."""

from __future__ import annotations

import random
import time

import anyio
import httpx

from tests.chaos.helpers import metrics, stream_completion
from tests.http.conftest import ServerProcess

N = 300


def test_a_disconnect_storm_leaves_nothing_behind(plain: ServerProcess) -> None:
    """On the package's plain server (tests/chaos/conftest.py)."""
    rng = random.Random(7)
    plan = [
        (
            f"Storm request {i}: tell me about the number {i} and its neighbours.",
            rng.randint(4, 24),
            rng.uniform(0.0, 4.0) if i % 2 else None,
        )
        for i in range(N)
    ]
    finished: list[tuple[int, int | None, str | None]] = []
    cut = 0

    async def storm() -> None:
        limits = httpx.Limits(max_connections=N + 8)
        async with httpx.AsyncClient(base_url=plain.base_url, timeout=300, limits=limits) as client:

            async def one(prompt: str, max_tokens: int, cut_after: float | None) -> None:
                nonlocal cut
                if cut_after is None:
                    r = await stream_completion(client, prompt, max_tokens)
                    finished.append((max_tokens, r.completion_tokens, r.finish_reason))
                    return
                with anyio.move_on_after(cut_after) as scope:
                    await stream_completion(client, prompt, max_tokens)
                cut += scope.cancelled_caught

            with anyio.fail_after(300):
                async with anyio.create_task_group() as tg:
                    for prompt, max_tokens, cut_after in plan:
                        tg.start_soon(one, prompt, max_tokens, cut_after)

    anyio.run(storm)
    assert len(finished) == N // 2
    assert all(tokens == want and reason == "length" for want, tokens, reason in finished), finished[:5]
    assert cut > N // 4  # most of the other half really were cut mid-request

    deadline = time.monotonic() + 15
    while True:
        m = metrics(plain.base_url)
        leftovers = {
            "running": m[("sonar:num_requests_running", ())],
            "waiting": m[("sonar:num_requests_waiting", ())],
            "kv_usage": m[("sonar:kv_cache_usage_perc", ())],
            **{
                actor: m[("sonar:requests_tracked", (("actor", actor),))]
                for actor in ("frontend", "scheduler", "detokenizer")
            },
        }
        if not any(leftovers.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not any(leftovers.values()), leftovers
