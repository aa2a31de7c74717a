"""`python -m sonar bench startup`: how long the server takes to be ready and to answer.

Each run starts ``python -m sonar serve SERVER_ARGS...`` (the arguments after ``--``) and
measures, from the moment the process is spawned, the time until ``/health`` answers 200
(ready) and until the first streamed token of a one-token completion (first token). The
breakdown comes from the server's ``sonar serve: startup: phase=seconds ...`` line (weights,
convert, kv_cache, warmup, ready: whatever phases it prints; ``ready`` is read as the server's
own total, and two derived rows are added: ``other``, the part of that total no named phase
covers, and ``before_server_clock``, the time from spawning the process to the server's clock
starting, i.e. the interpreter and imports). "Cold" runs start with an empty
``SONAR_CACHE_ROOT`` (a fresh temporary directory: nothing converted or compiled yet); "warm"
runs reuse the directory the cold run before them filled. Both share this machine's native CPU
kernels: those are built once per machine by the setup (``scripts/_setup.sh``), not by a server's
first start, so a cold run is the first ``sonar serve`` after setup.

usage: python -m sonar bench startup [--runs N] [--modes cold,warm] [-- SERVER_ARGS...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from sonar.bench.launch import ServerFailed, launch, parse_startup_phases, split_server_args, stop
from sonar.paths import cache_root


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=3, help="runs per mode")
    p.add_argument("--modes", default="cold,warm", help="which of cold, warm to measure (comma-separated)")
    p.add_argument(
        "--server-command",
        default=None,
        help="the command that starts the server instead of `python -m sonar serve` ({port} is replaced by the port)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to get ready")
    p.add_argument("--log-dir", default=None, help="keep the servers' stdout/stderr here")
    p.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    return p


def first_token(base_url: str, spawned: float, timeout: float = 300.0) -> tuple[float, float]:
    """Send a one-token streamed completion; (seconds since `spawned`, seconds since sending)."""
    with httpx.Client(timeout=timeout) as client:
        models = client.get(f"{base_url}/v1/models").json().get("data") or []
        body = {
            "model": models[0]["id"] if models else "default",
            "prompt": "Hello",
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": True,
        }
        sent = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise ServerFailed(f"the first request failed: HTTP {response.status_code} {response.read()[:300]!r}")
            for line in response.iter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    now = time.perf_counter()
                    return now - spawned, now - sent
    raise ServerFailed("the first request's stream carried no token")


def one_run(
    mode: str, index: int, cache_root: Path, server_args: list[str], args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    """Start the server once with `cache_root` as SONAR_CACHE_ROOT and time it."""
    server = launch(
        server_args,
        log_dir,
        command=args.server_command,
        env={"SONAR_CACHE_ROOT": str(cache_root)},
        timeout=args.timeout,
        name=f"{mode}-{index}",
    )
    try:
        to_token, ttft = first_token(server.base_url, server.started)
    finally:
        code = stop(server)
    phases = parse_startup_phases(server.out())
    if "ready" in phases:
        # The server's clock starts after the interpreter and the imports; what the phases it
        # names do not cover is shown too.
        phases["other"] = max(0.0, phases["ready"] - sum(v for k, v in phases.items() if k != "ready"))
        phases["before_server_clock"] = max(0.0, server.ready_seconds - phases["ready"])
    return {
        "mode": mode,
        "run": index,
        "ready_s": server.ready_seconds,
        "first_token_s": to_token,
        "ttft_s": ttft,
        "phases": phases,
        "exit_code": code,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: mean, min and max of ready, first token and each startup phase."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        keys = ["ready_s", "first_token_s", "ttft_s"]
        values = {k: [r[k] for r in mine] for k in keys}
        for r in mine:
            for phase, v in r["phases"].items():
                values.setdefault(f"phase:{phase}", []).append(v)
        out[mode] = {
            k: {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in values.items()
        }
    return out


def format_report(summary: dict[str, dict[str, Any]]) -> str:
    width = 62
    lines = [" Startup Benchmark Result ".center(width, "=")]
    lines.append(f"{'':<26}{'mean':>12}{'min':>12}{'max':>12}")
    for mode, stats in summary.items():
        lines.append(f" {mode} (n={stats['ready_s']['n']}) ".center(width, "-"))
        names = {
            "ready_s": "ready (/health 200) (s)",
            "first_token_s": "first token (s)",
            "ttft_s": "  first request's TTFT (s)",
            "phase:ready": "  server's own total (s)",
        }
        for key, st in stats.items():
            phase = key.removeprefix("phase:")
            name = names.get(key, f"  {phase.replace('_', ' ')} (s)")
            lines.append(f"{name:<26}{st['mean']:>12.2f}{st['min']:>12.2f}{st['max']:>12.2f}")
        if not any(k.startswith("phase:") for k in stats):
            lines.append("(the server printed no `sonar serve: startup:` line)")
    lines.append("=" * width)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, server_args = split_server_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    modes = [m for m in ("cold", "warm") if m in asked]  # a warm run reuses the cold run's cache
    if not modes or len(modes) != len(set(asked)) or args.runs < 1:
        print("bench startup: --modes takes cold and/or warm, --runs at least 1", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sonar-bench-startup-"))
    log_dir = Path(args.log_dir) if args.log_dir else work / "logs"
    runs: list[dict[str, Any]] = []
    try:
        for i in range(args.runs):
            cache = work / f"cache-{i}"
            cache.mkdir()
            if (cache_root() / "native").is_dir():
                (cache / "native").symlink_to(cache_root() / "native", target_is_directory=True)
            if "cold" not in modes:  # fill the cache once, unmeasured
                one_run("fill", i, cache, server_args, args, log_dir)
            for mode in modes:
                run = one_run(mode, i, cache, server_args, args, log_dir)
                runs.append(run)
                print(
                    f"bench startup: {mode} run {i + 1}/{args.runs}: ready {run['ready_s']:.2f} s, "
                    f"first token {run['first_token_s']:.2f} s",
                    flush=True,
                )
            shutil.rmtree(cache, ignore_errors=True)
    except ServerFailed as exc:
        print(f"bench startup: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    print(format_report(summary))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "server_args": server_args,
                    "server_command": args.server_command,
                    "runs": runs,
                    "summary": summary,
                },
                indent=2,
            )
        )
        print(f"bench startup: result written to {path}")
    return 0
