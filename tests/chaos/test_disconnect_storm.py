"""100 streaming requests at once, half of them cut off by their clients: a quarter at random
moments early on (waiting, or in their prefill), a quarter after a random number of streamed tokens
(mid-decode, however fast the machine). The others finish whole, and afterwards nothing is left
behind: no request state in the frontend, the scheduler or the detokenizer, and no KV block held."""

from __future__ import annotations

import random
import time

import anyio
import httpx

from tests.chaos.helpers import metrics, stream_completion
from tests.http.conftest import ServerProcess

N = 100
#: An early cut comes within this many seconds of the request's start (the prefill of 100 prompts
#: takes longer).
EARLY_CUT_WITHIN = 1.0


def test_a_disconnect_storm_leaves_nothing_behind(plain: ServerProcess) -> None:
    """On the package's plain server (tests/chaos/conftest.py)."""
    rng = random.Random(7)
    # (prompt, max_tokens, cut after seconds, cut after chunks)
    plan: list[tuple[str, int, float | None, int | None]] = []
    for i in range(N):
        max_tokens = rng.randint(4, 24)
        seconds = rng.uniform(0.0, EARLY_CUT_WITHIN) if i % 4 == 1 else None
        chunks = rng.randint(1, max_tokens - 1) if i % 4 == 3 else None
        plan.append(
            (f"Storm request {i}: tell me about the number {i} and its neighbours.", max_tokens, seconds, chunks)
        )
    finished: list[tuple[int, int | None, str | None]] = []
    cut = 0

    async def storm() -> None:
        limits = httpx.Limits(max_connections=N + 8)
        async with httpx.AsyncClient(base_url=plain.base_url, timeout=300, limits=limits) as client:

            async def one(prompt: str, max_tokens: int, seconds: float | None, chunks: int | None) -> None:
                nonlocal cut
                if seconds is None and chunks is None:
                    r = await stream_completion(client, prompt, max_tokens)
                    finished.append((max_tokens, r.completion_tokens, r.finish_reason))
                    return
                seen = 0

                async def count() -> None:
                    nonlocal seen
                    seen += 1
                    if seen == chunks:
                        scope.cancel()

                with anyio.CancelScope() as scope:
                    if seconds is not None:
                        scope.deadline = anyio.current_time() + seconds
                    await stream_completion(client, prompt, max_tokens, count)
                cut += scope.cancelled_caught

            with anyio.fail_after(300):
                async with anyio.create_task_group() as tg:
                    for prompt, max_tokens, seconds, chunks in plan:
                        tg.start_soon(one, prompt, max_tokens, seconds, chunks)

    anyio.run(storm)
    assert len(finished) == N // 2
    assert all(tokens == want and reason == "length" for want, tokens, reason in finished), finished[:5]
    # every cut after chunks came mid-stream (before the last token), and most early ones too
    assert cut > N // 4

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
