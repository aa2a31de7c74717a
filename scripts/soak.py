"""Soak test: mixed load on a real server for a while, with the worker SIGKILLed periodically.

    .venv/bin/python scripts/soak.py --minutes 10 --kill-every 60 [--json out.json] [-- SERVE ARGS...]

Passes when no request failed, every kill was followed by a restart, and the server process's
memory stayed flat (its resident size at the end within --rss-slack MiB of where it was after the
warm-up). Prints a summary and exits 0 on pass, 1 on fail. Not part of CI (it runs for minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from sonar.bench.launch import free_port
from sonar.procfs import resident_bytes

ROOT = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float:
    return (resident_bytes(pid) or 0) / 2**20


def worker(base: str) -> dict[str, Any]:
    def walk(node: dict[str, Any]) -> Any:
        if node["name"] == "worker":
            return node
        return next((found for c in node.get("children", []) if (found := walk(c))), None)

    return walk(httpx.get(f"{base}/actors", timeout=10).json())


async def one_request(client: httpx.AsyncClient, rng: random.Random, stats: dict[str, Any]) -> None:
    kind = rng.choice(["complete", "stream", "chat", "chat-stream", "n2"])
    max_tokens = rng.randint(4, 48)
    topic = rng.choice(["the sea", "a city at night", "prime numbers", "bread", "a long journey"])
    if kind.startswith("chat"):
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Write about {topic}."}],
                                             "max_tokens": max_tokens}
    else:
        path, body = "/v1/completions", {"prompt": f"A few words about {topic}:", "max_tokens": max_tokens}
    body["temperature"] = rng.choice([0.0, 0.7])
    if kind == "n2":
        body["n"] = 2
    stream = kind.endswith("stream")
    body["stream"] = stream
    try:
        if stream:
            done = False
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"error"' in line:
                        raise RuntimeError(line[:200])
                    done = done or line == "data: [DONE]"
            if not done:
                raise RuntimeError("stream ended without [DONE]")
        else:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
            reasons = {c["finish_reason"] for c in r.json()["choices"]}
            if not reasons <= {"stop", "length"}:
                raise RuntimeError(f"finish reasons {reasons}")
        stats["ok"] += 1
    except Exception as exc:
        stats["failed"] += 1
        stats["errors"].append(f"{kind}: {type(exc).__name__}: {exc}")


async def soak(args: argparse.Namespace, base: str, server_pid: int) -> dict[str, Any]:
    stats: dict[str, Any] = {"ok": 0, "failed": 0, "errors": [], "kills": 0, "samples": []}
    end = time.monotonic() + args.minutes * 60
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def load(i: int) -> None:
            local = random.Random(rng.random())
            while time.monotonic() < end:
                await one_request(client, local, stats)

        async def kill() -> None:
            while True:
                await anyio.sleep(args.kill_every)
                if time.monotonic() > end - 10:
                    return
                pid = worker(base)["pid"]
                os.kill(pid, signal.SIGKILL)
                stats["kills"] += 1
                print(f"  killed worker {pid} at {args.minutes * 60 - (end - time.monotonic()):.0f} s", flush=True)

        async def sample() -> None:
            while time.monotonic() < end:
                w = worker(base)
                stats["samples"].append({"t": round(time.monotonic(), 1), "server_rss_mib": round(rss_mib(server_pid), 1),
                                         "worker_rss_mib": round(rss_mib(w["pid"]) if w["pid"] else 0, 1),
                                         "ok": stats["ok"], "failed": stats["failed"]})
                await anyio.sleep(5)

        async with anyio.create_task_group() as tg:
            for i in range(args.concurrency):
                tg.start_soon(load, i)
            tg.start_soon(sample)
            kill_scope = anyio.CancelScope()

            async def kills() -> None:
                with kill_scope:
                    await kill()
            tg.start_soon(kills)
            await anyio.sleep(args.minutes * 60)
            kill_scope.cancel()
    stats["restarts"] = worker(base)["restarts"]
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between worker SIGKILLs")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-slack", type=float, default=64.0, help="MiB the server may grow after warm-up")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "sonar-soak-server.log"),
                        help="where the server's output goes")
    parser.add_argument("serve_args", nargs="*", help="extra `sonar serve` arguments (after --)")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    log_path = Path(args.log)
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--disable-uvicorn-access-log", *args.serve_args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                print(f"the server exited during start-up; see {log_path}")
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        print(f"server log: {log_path}")
        print(f"soaking {base} for {args.minutes:g} min, worker killed every {args.kill_every:g} s", flush=True)
        stats = anyio.run(soak, args, base, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    samples = stats["samples"]
    warm = [s for s in samples if s["t"] - samples[0]["t"] >= 60] or samples
    rss_after_warmup, rss_end = warm[0]["server_rss_mib"], samples[-1]["server_rss_mib"]
    growth = rss_end - rss_after_warmup
    passed = stats["failed"] == 0 and stats["restarts"] >= stats["kills"] and growth <= args.rss_slack and code == 0
    summary = {"minutes": args.minutes, "requests_ok": stats["ok"], "requests_failed": stats["failed"],
               "worker_kills": stats["kills"], "worker_restarts": stats["restarts"],
               "server_rss_after_warmup_mib": rss_after_warmup, "server_rss_end_mib": rss_end,
               "server_rss_max_mib": max(s["server_rss_mib"] for s in samples), "exit_code": code,
               "passed": passed, "errors": stats["errors"][:20]}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "samples": samples}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
