"""A client that goes away aborts its request in the engine, streamed or not.

This module runs the app in-process (uvicorn on a free port, in the test's event loop) so that
it can ask the engine itself (`llm.stats()`) whether the request is gone.
"""

from __future__ import annotations

import anyio
import httpx
import pytest
import uvicorn

import sonar
from sonar.http.app import build_app
from sonar.http.frontend import _make_server
from sonar.http.settings import ServerSettings
from tests.http.conftest import free_port

pytestmark = pytest.mark.anyio

PROMPT = "Once upon a time, in a small village by the sea,"


async def wait_idle(llm: sonar.LLM, timeout: float = 5.0) -> None:
    stats = None
    with anyio.move_on_after(timeout):
        while True:
            stats = await llm.stats()
            if (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, llm.info.num_blocks):
                return
            await anyio.sleep(0.05)
    pytest.fail(f"the request still holds the engine {timeout} s after the client left: {stats}")


async def wait_running(llm: sonar.LLM) -> None:
    with anyio.fail_after(10):
        while (await llm.stats()).num_running == 0:
            await anyio.sleep(0.02)


async def test_disconnect_aborts_streamed_and_whole_requests(one_thread):
    async with sonar.open(dtype="float32", max_model_len=256, num_gpu_blocks_override=64) as llm:
        port = free_port()
        app = build_app(llm, ServerSettings(served_model_names=("smol",)))
        server = _make_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            with anyio.fail_after(10):
                while not server.started:
                    await anyio.sleep(0.02)
            long = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                # Streamed: read one event, then hang up.
                async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break
                    assert (await llm.stats()).num_running == 1
                await wait_idle(llm)

                # Whole (not streamed): the client gives up while the engine works.
                for path, body in (
                    ("/v1/completions", long),
                    (
                        "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": True},
                    ),
                ):
                    async with anyio.create_task_group() as calls:
                        calls.start_soon(lambda path=path, body=body: client.post(path, json=body))
                        await wait_running(llm)
                        calls.cancel_scope.cancel()
                    await wait_idle(llm)

                # The engine still serves.
                r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            server.should_exit = True
