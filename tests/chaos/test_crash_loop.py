"""A worker that crashes on every step: the engine's supervisor restarts it until its restart
intensity is spent, then gives up. Clients get 503 OpenAI errors (never a hang), `/health` says
503, and the process exits 1 within its shutdown deadline leaving no child process behind."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import httpx

from tests.actors.helpers import alive
from tests.chaos.helpers import ENGINE_ARGS, PROMPTS, actor, stream_completion
from tests.http.conftest import start_server, stop_server


def children_of(pid: int) -> list[int]:
    """Actor processes started by the server `pid` (they name their parent on the command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in argv and argv[argv.index(b"--parent-pid") + 1] == str(pid).encode():
            if alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_a_crash_loop_ends_in_503s_and_exit_code_1(tmp_path: Path) -> None:
    server = start_server(tmp_path, *ENGINE_ARGS, "--fault-injection", "raise@p=1")
    try:
        base = server.base_url
        first_worker = actor(base, "worker")["pid"]
        assert children_of(server.proc.pid) == [first_worker]
        health: list[int] = []
        outcomes: list[tuple[str, int, dict]] = []

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:

                async def whole(i: int) -> None:
                    r = await client.post(
                        "/v1/completions",
                        json={"model": "smol", "prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0},
                    )
                    outcomes.append(("whole", r.status_code, r.json()))

                async def streamed(i: int) -> None:
                    r = await stream_completion(client, PROMPTS[i], 8)
                    outcomes.append(("stream", r.status, r.error or {}))

                async def watch_health() -> None:
                    while server.proc.poll() is None:
                        try:
                            health.append((await client.get("/health", timeout=5)).status_code)
                        except httpx.TransportError:
                            if server.proc.poll() is not None:
                                break  # the server has exited
                            # else a probe that timed out on a loaded machine: probe again
                        await anyio.sleep(0.2)

                with anyio.fail_after(150):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(watch_health)
                        for i in range(3):
                            tg.start_soon(whole, i)
                            tg.start_soon(streamed, 3 + i)

        started = time.monotonic()
        anyio.run(scenario)
        # Every request ended with a 503 OpenAI error: a whole response with that status, or a
        # stream's error event (its 200 status line may have gone out before the engine gave up).
        assert len(outcomes) == 6
        for kind, status, body in outcomes:
            error = body.get("error", {})
            assert error.get("code") == 503 and error.get("type") == "ServiceUnavailableError", (kind, status, body)
            if kind == "whole":
                assert status == 503
        assert 503 in health
        code = server.proc.wait(timeout=30)
        assert code == 1, server.log()[-3000:]
        assert time.monotonic() - started < 150
        assert not alive(first_worker) and children_of(server.proc.pid) == []
        out = server.out() + server.log()
        assert "gave up" in out and out.count("injected fault in the forward pass") >= 6
    finally:
        stop_server(server)
