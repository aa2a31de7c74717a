"""`python -m sonar bench sweep`: `bench serve` over a grid of server flags.

Each ``--param NAME=V1,V2,...`` is one axis; every combination is one point. For each point the
server is started (``python -m sonar serve SERVER_ARGS... --NAME VALUE ...``, the arguments after
``--`` shared by all points), loaded with the same `bench serve` run, and stopped. A value of
``true``/``false`` turns a boolean flag on or leaves it out. Prints a table, and with ``--plot``
draws output throughput against mean TPOT and mean TTFT.

usage: python -m sonar bench sweep --param max-num-seqs=8,16 [SERVE FLAGS...] [-- SERVER_ARGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sonar.bench.launch import ServerFailed, launch, split_server_args, stop
from sonar.bench.serve import add_serve_arguments, run_serve


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=V1,V2,...",
        help="a server flag (without --) and its values; repeat for more axes",
    )
    g.add_argument(
        "--server-command",
        default=None,
        help="the command that starts the server instead of `python -m sonar serve` ({port} is replaced by the port)",
    )
    g.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to get ready")
    g.add_argument("--log-dir", default=None, help="keep the servers' stdout/stderr here")
    add_serve_arguments(p, server=False)
    return p


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["max-num-seqs=8,16"]`` -> ``[("max-num-seqs", ["8", "16"])]``."""
    grid = []
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip().lstrip("-")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name or not vals:
            raise ValueError(f"--param takes NAME=V1,V2,..., not {item!r}")
        grid.append((name, vals))
    if not grid:
        raise ValueError("give at least one --param NAME=V1,V2,...")
    return grid


def point_args(point: dict[str, str]) -> list[str]:
    """Server flags for one grid point (true: the bare flag, false: nothing)."""
    out: list[str] = []
    for name, value in point.items():
        if value.lower() == "true":
            out.append(f"--{name}")
        elif value.lower() != "false":
            out += [f"--{name}", value]
    return out


def format_table(grid: list[tuple[str, list[str]]], points: list[dict[str, Any]]) -> str:
    names = [n for n, _ in grid]
    cols = [
        ("ok", "completed", "d"),
        ("fail", "failed", "d"),
        ("req/s", "request_throughput", ".2f"),
        ("out tok/s", "output_throughput", ".1f"),
        ("TTFT ms", "mean_ttft_ms", ".0f"),
        ("TPOT ms", "mean_tpot_ms", ".1f"),
        ("ITL ms", "mean_itl_ms", ".1f"),
        ("E2EL ms", "mean_e2el_ms", ".0f"),
        ("KV peak %", "kv", ".1f"),
        ("preempt", "preempt", "d"),
    ]
    head = "  ".join(f"{n:>22}" for n in names) + "".join(f"{c:>11}" for c, _, _ in cols)
    lines = [" Sweep Result (means) ".center(len(head), "="), head]
    for p in points:
        r = dict(p["result"])
        server = r.get("server") or {}
        r["kv"] = server.get("peak_kv_cache_usage") * 100 if server.get("peak_kv_cache_usage") is not None else None
        r["preempt"] = int(server["num_preemptions"]) if server.get("num_preemptions") is not None else None
        row = "  ".join(f"{p['params'][n]:>22}" for n in names)
        for _, key, fmt in cols:
            v = r.get(key)
            row += f"{format(v, fmt):>11}" if v is not None else f"{'n/a':>11}"
        lines.append(row)
    lines.append("=" * len(head))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv, server_args = split_server_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    try:
        grid = parse_grid(args.param)
    except ValueError as exc:
        print(f"bench sweep: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="sonar-bench-sweep-"))
    log_dir = Path(args.log_dir) if args.log_dir else work
    points: list[dict[str, Any]] = []
    combos = list(itertools.product(*[vals for _, vals in grid]))
    try:
        for i, combo in enumerate(combos):
            params = {name: value for (name, _), value in zip(grid, combo)}
            label = ",".join(f"{k}={v}" for k, v in params.items())
            print(f"bench sweep: point {i + 1}/{len(combos)}: {label}", flush=True)
            server = launch(
                [*server_args, *point_args(params)],
                log_dir,
                command=args.server_command,
                timeout=args.server_timeout,
                name=f"point-{i}",
            )
            try:
                args.server_pid = server.proc.pid
                result, _, _ = asyncio.run(run_serve(args, server.base_url))
            finally:
                stop(server)
            result = {
                k: v
                for k, v in result.items()
                if k not in ("input_lens", "output_lens", "ttfts", "itls", "e2els", "start_times", "errors")
            }
            points.append({"params": params, "label": label, "server_ready_s": server.ready_seconds, "result": result})
    except (ServerFailed, RuntimeError, ValueError) as exc:
        print(f"bench sweep: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(grid, points))
    if args.save_result:
        name = args.result_filename or f"sweep-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}.json"
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "grid": dict(grid),
                    "server_args": server_args,
                    "points": points,
                },
                indent=2,
            )
        )
        print(f"bench sweep: result written to {path}")
    if args.plot:
        from sonar.bench.plot import plot_sweep

        print(f"bench sweep: plot written to {plot_sweep(points, args.plot, 'bench sweep')}")
    return 0 if all(p["result"]["completed"] > 0 for p in points) else 1
