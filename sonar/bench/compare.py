"""`python -m sonar bench compare`: Sonar against its peers over the whole load curve.

Starts Sonar and each peer it is given (llama.cpp's `llama-server` on a GGUF of the same
weights, vLLM's CPU build, or any OpenAI-compatible server command) one after another, each with
KV room for the grid's largest load, then runs the same `bench serve` load against each server
in turn: every concurrency × every input length (random prompts, fixed output, EOS ignored), and
a shared-prefix workload (one long system prompt before every request's own text, as chat
traffic sends), for several rounds with the order of the servers rotated every round. While one
server is measured the peers that poll when idle are paused (SIGSTOP to their process group).

Every cell of a round draws fresh prompts (its own seed) and all servers get the same ones, so no
server answers from a cache warmed by an earlier run; within the shared-prefix workload the
prefix repeats, as it should. The weight-read floor of a decode step is measured in the same
run: the model's weight bytes over this machine's read bandwidth, read with every server idle.
Peak memory is the proportional set size of each server's whole process tree, sampled while it
runs. Writes ``compare.json`` and ``compare.md`` (one table per workload, the goals of issue 20
judged per cell) into ``--out`` after every run, marked partial until the last, and one PNG per
workload at the end. SIGINT or SIGTERM stops every server it started, writes what was measured
and exits with 128 + the signal's number.

usage: python -m sonar bench compare --out DIR [--model-dir HF_DIR] [--llama-server BIN --gguf FILE]
       [--vllm-venv DIR] [--peer NAME=COMMAND] [--concurrency 1,4,16,64] [--input-len 128,1024,4096]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import sys
import threading
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sonar.bench.bandwidth import read_bandwidth_gbs
from sonar.bench.compare_report import RUN_KEYS, format_markdown, judge, runs_done
from sonar.bench.floor import DTYPE_BYTES
from sonar.bench.launch import LaunchedServer, ServerFailed, launch, stop
from sonar.bench.peers import (
    Load,
    ServerSpec,
    kv_bytes_per_token,
    kv_gib,
    llama_spec,
    parse_peer,
    pause,
    resume,
    sonar_spec,
    vllm_spec,
)
from sonar.procfs import tree_proportional_bytes

SUBJECT = "sonar"


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, not {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("servers")
    g.add_argument(
        "--model-dir",
        default=None,
        help="a local HF model folder Sonar and vLLM serve (default: Sonar serves its embedded model)",
    )
    g.add_argument("--sonar-args", default="", help="extra `sonar serve` flags, as one shell-quoted string")
    g.add_argument(
        "--llama-server", default=None, help="llama.cpp's llama-server binary (../shared/peers/llama_cpp.sh)"
    )
    g.add_argument("--gguf", default=None, help="the GGUF file llama-server serves (the same weights as --model-dir)")
    g.add_argument("--vllm-venv", default=None, help="vLLM's CPU build (../shared/peers/vllm_cpu.sh)")
    g.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="another server: the command starts it listening on {port}; repeat for more",
    )
    g.add_argument(
        "--pause-idle",
        action="append",
        default=[],
        metavar="NAME",
        help="also pause this --peer while the others run (llama.cpp and vLLM always are)",
    )
    g.add_argument(
        "--kv-gib",
        type=int,
        default=None,
        help="KV cache GiB for Sonar and vLLM (default: sized for the grid's largest load from config.json; "
        "0: each server's own default)",
    )
    g.add_argument("--server-timeout", type=float, default=900.0, help="seconds a server may take to get ready")
    g = p.add_argument_group("grid")
    g.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64], help="concurrencies, e.g. 1,4,16,64")
    g.add_argument("--input-len", type=_ints, default=[128, 1024, 4096], help="prompt lengths in tokens")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request (EOS ignored)")
    g.add_argument(
        "--prefix-len",
        type=int,
        default=1024,
        help="the shared-prefix workload's system prompt in tokens (0: no such workload)",
    )
    g.add_argument("--suffix-len", type=int, default=128, help="each shared-prefix request's own text in tokens")
    g.add_argument("--prompts-per-slot", type=int, default=2, help="requests per cell: this × the concurrency")
    g.add_argument("--min-prompts", type=int, default=8, help="at least this many requests per cell")
    g.add_argument("--rounds", type=int, default=2, help="times the whole grid runs, the server order rotated")
    g = p.add_argument_group("floor and output")
    g.add_argument("--tokenizer", default=None, help="the client's tokenizer folder (default: --model-dir)")
    g.add_argument(
        "--floor-dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="the dtype the weights are read in"
    )
    g.add_argument(
        "--weight-bytes", type=float, default=None, help="weight bytes read per decode step (default: params × dtype)"
    )
    g.add_argument("--out", required=True, help="the folder for compare.json, compare.md, the plots and server logs")
    return p


def grid_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cell of the grid, the random workload first, then the shared-prefix one."""
    cells = [
        {"workload": "random", "concurrency": c, "input_len": n, "output_len": args.output_len}
        for n in args.input_len
        for c in args.concurrency
    ]
    if args.prefix_len > 0:
        cells += [
            {
                "workload": "shared-prefix",
                "concurrency": c,
                "input_len": args.prefix_len + args.suffix_len,
                "prefix_len": args.prefix_len,
                "output_len": args.output_len,
            }
            for c in args.concurrency
        ]
    for cell in cells:
        cell["num_prompts"] = max(args.min_prompts, args.prompts_per_slot * cell["concurrency"])
    return cells


def warm_up_cell(cells: list[dict[str, Any]], max_concurrency: int) -> dict[str, Any]:
    """The cell each server runs first, not counted: random prompts at concurrency up to 4, as long
    as the grid's longest up to 64 tokens, outputs up to 16 tokens; no bigger than the grid itself
    (a small grid's run is not spent mostly warming up)."""
    return {
        "workload": "random",
        "concurrency": min(4, max_concurrency),
        "input_len": min(64, max(c["input_len"] for c in cells)),
        "output_len": min(16, max(c["output_len"] for c in cells)),
        "num_prompts": min(8, max(c["num_prompts"] for c in cells)),
    }


def server_specs(args: argparse.Namespace, load: Load) -> list[ServerSpec]:
    """Sonar first, then each peer asked for (llama.cpp, vLLM, --peer ones)."""
    per_token = kv_bytes_per_token(Path(args.model_dir)) if args.model_dir else None
    gib = args.kv_gib if args.kv_gib is not None else (kv_gib(load, per_token) if per_token else None)
    specs = [sonar_spec(args.model_dir, shlex.split(args.sonar_args), gib or None)]
    if args.llama_server:
        if not args.gguf:
            raise ValueError("--llama-server needs --gguf (the same weights as a GGUF file)")
        specs.append(llama_spec(args.llama_server, args.gguf, load))
    if args.vllm_venv:
        if not args.model_dir:
            raise ValueError("--vllm-venv needs --model-dir (the HF folder vLLM serves)")
        specs.append(vllm_spec(args.vllm_venv, args.model_dir, gib or None))
    specs += [parse_peer(text, pause_when_idle=text.partition("=")[0].strip() in args.pause_idle) for text in args.peer]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must differ: {names}")
    return specs


class MemoryWatch:
    """Samples the summed Pss of a process tree on a thread; `peak` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval = pid, interval
        self.peak = tree_proportional_bytes(pid) or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, tree_proportional_bytes(self.pid) or 0)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_proportional_bytes(self.pid) or 0)


def serve_args(
    args: argparse.Namespace, cell: dict[str, Any], seed: int, pid: int, bandwidth_gbs: float
) -> argparse.Namespace:
    """The `bench serve` flags of one cell's run (its floor at the run's one measured bandwidth)."""
    from sonar.bench.serve import build_parser as serve_parser

    argv = ["--ignore-eos", "--disable-tqdm", "--seed", str(seed), "--max-concurrency", str(cell["concurrency"])]
    argv += ["--num-prompts", str(cell["num_prompts"]), "--metrics-interval", "1.0"]
    if cell["workload"] == "shared-prefix":
        argv += ["--dataset-name", "prefix-repetition", "--prefix-repetition-num-prefixes", "1"]
        argv += ["--prefix-repetition-prefix-len", str(cell["prefix_len"])]
        argv += ["--prefix-repetition-suffix-len", str(cell["input_len"] - cell["prefix_len"])]
        argv += ["--prefix-repetition-output-len", str(cell["output_len"])]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(cell["input_len"])]
        argv += ["--random-output-len", str(cell["output_len"])]
    tokenizer = args.tokenizer or args.model_dir
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    argv += ["--peak-bandwidth-gbs", str(bandwidth_gbs)]
    ns = serve_parser().parse_args(argv)
    ns.server_pid = pid
    return ns


def run_cell(
    args: argparse.Namespace, server: LaunchedServer, cell: dict[str, Any], seed: int, bandwidth_gbs: float
) -> dict[str, Any]:
    """One `bench serve` run of `cell` against `server`: the figures a comparison keeps."""
    from sonar.bench.serve import run_serve

    ns = serve_args(args, cell, seed, server.proc.pid, bandwidth_gbs)
    result, _, _ = asyncio.run(run_serve(ns, server.base_url, log=_quiet))
    kept = {k: result.get(k) for k in RUN_KEYS}
    kept["errors"] = sorted({e for e in result.get("errors") or [] if e})
    kept["prefix_cache_hit_rate"] = (result.get("server") or {}).get("prefix_cache_hit_rate")
    return kept


def _quiet(*_: object) -> None:
    """`bench serve`'s progress lines are left out: compare prints one line per run."""


def _stop_all(servers: dict[str, tuple[ServerSpec, LaunchedServer]]) -> None:
    for spec, server in servers.values():
        try:
            resume(server.proc.pid)
        except ProcessLookupError:
            pass
        stop(server)
        try:  # what the leader left behind (an engine process that missed its parent's exit)
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class StopSignals:
    """While entered, the first SIGINT or SIGTERM raises KeyboardInterrupt as long as `armed`; any
    later one (or one after `armed` is cleared) is only noted in `signum`, so that stopping the
    servers and writing what was measured are not cut short. The previous handlers come back on
    exit. A KeyboardInterrupt for SIGTERM too, so that it unwinds as Ctrl-C does: asyncio lets one
    out of the event loop at once instead of handing it to one request's task, where `bench serve`
    would count it as that request's failure."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.armed = True
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cells = grid_cells(args)
    load = Load(
        max(c["concurrency"] for c in cells), max(c["input_len"] for c in cells), max(c["output_len"] for c in cells)
    )
    try:
        specs = server_specs(args, load)
    except ValueError as exc:
        print(f"bench compare: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "subject": SUBJECT,
        "argv": sys.argv[1:] if argv is None else argv,
        "cpus": os.cpu_count(),
        "floor": None,
        "servers": [],
        "cells": cells,
        "runs_planned": args.rounds * len(cells) * len(specs),
    }
    servers: dict[str, tuple[ServerSpec, LaunchedServer]] = {}
    error: Exception | None = None
    with StopSignals() as signals:
        try:
            _measure(args, specs, out, servers, result)
        except KeyboardInterrupt:
            pass  # raised by `signals` (SIGINT's handler too while entered), whose `signum` says which
        except (ServerFailed, RuntimeError) as exc:
            error = exc
        finally:
            signals.armed = False
            _stop_all(servers)
        if signals.signum:
            result["stopped_by"] = signal.Signals(signals.signum).name
        report = _write_results(out, result)
        if error:
            print(f"bench compare: {error}", file=sys.stderr)
        if signals.signum or error:
            print(
                f"bench compare: stopped after {result['runs_done']} of {result['runs_planned']} runs; written to {out}",
                file=sys.stderr,
            )
            return 128 + signals.signum if signals.signum else 1
    from sonar.bench.plot import plot_compare

    names = [s["name"] for s in result["servers"]]
    for workload in dict.fromkeys(c["workload"] for c in cells):
        plot_compare([c for c in cells if c["workload"] == workload], names, out / f"compare-{workload}.png")
    print(report)
    print(f"bench compare: written to {out}")
    return 0 if all(not r["failed"] for c in cells for runs in c["runs"].values() for r in runs) else 1


def _measure(
    args: argparse.Namespace,
    specs: list[ServerSpec],
    out: Path,
    servers: dict[str, tuple[ServerSpec, LaunchedServer]],
    result: dict[str, Any],
) -> None:
    """Start every server (into `servers`, for the caller to stop), then run the grid's rounds,
    adding each run to its cell of ``result["cells"]`` and writing the results after each."""
    cells = result["cells"]
    info: dict[str, dict[str, Any]] = {}
    for spec in specs:
        print(f"bench compare: starting {spec.name}: {spec.command}", flush=True)
        server = launch(
            [],
            out / "logs",
            command=spec.command,
            env=spec.env,
            timeout=args.server_timeout,
            name=spec.name,
            new_session=True,
        )
        servers[spec.name] = (spec, server)
        # the pid also names the server's process group: a reader can check none outlived the run
        info[spec.name] = {
            **asdict(spec),
            "pid": server.proc.pid,
            "ready_s": server.ready_seconds,
            "peak_pss_bytes": 0,
        }
        result["servers"].append(info[spec.name])
        print(f"bench compare: {spec.name} ready in {server.ready_seconds:.1f} s", flush=True)
        if spec.pause_when_idle:
            pause(server.proc.pid)
    bandwidth = read_bandwidth_gbs()
    floor = result["floor"] = _floor(args, bandwidth)
    floor_text = f"{floor['floor_ms']:.2f} ms per decode step" if floor else "unknown (no model size)"
    print(f"bench compare: read bandwidth {bandwidth:.1f} GB/s; weight-read floor {floor_text}", flush=True)
    warm = warm_up_cell(cells, max(c["concurrency"] for c in cells))
    for r in range(args.rounds):
        order = list(servers)[r % len(servers) :] + list(servers)[: r % len(servers)]
        for i, cell in enumerate([warm] + cells if r == 0 else cells):
            for name in order:
                spec, server = servers[name]
                if spec.pause_when_idle:
                    resume(server.proc.pid)
                try:
                    with MemoryWatch(server.proc.pid) as watch:
                        run = run_cell(args, server, cell, 1000 * (r + 1) + i, bandwidth)
                finally:
                    if spec.pause_when_idle:
                        pause(server.proc.pid)
                info[name]["peak_pss_bytes"] = max(info[name]["peak_pss_bytes"], watch.peak)
                if cell is warm:
                    continue
                cell.setdefault("runs", {}).setdefault(name, []).append(run)
                print(
                    f"bench compare: round {r + 1} {cell['workload']} c={cell['concurrency']} "
                    f"in={cell['input_len']} {name}: {run['output_throughput']:.1f} tok/s, "
                    f"TTFT {run['mean_ttft_ms']:.0f} ms, TPOT {run['mean_tpot_ms']:.1f} ms, "
                    f"{run['failed']} failed",
                    flush=True,
                )
                _write_results(out, result)


def _write_results(out: Path, result: dict[str, Any]) -> str:
    """Judge the cells on the runs they have and write compare.json and compare.md; the markdown."""
    floor = result["floor"]
    judge(result["cells"], SUBJECT, floor["floor_ms"] if floor else None)
    result["runs_done"] = runs_done(result["cells"])
    result["partial"] = result["runs_done"] < result["runs_planned"]
    report = format_markdown(result)
    _write_atomically(out / "compare.json", json.dumps(result, indent=2))
    _write_atomically(out / "compare.md", report)
    return report


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder: a reader (or a stop midway) sees the
    previous version or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _floor(args: argparse.Namespace, bandwidth_gbs: float) -> dict[str, Any] | None:
    """The weight-read floor of a batch-1 decode step, or None when the model's size is unknown."""
    weight_bytes = args.weight_bytes
    if weight_bytes is None:
        from sonar.bench.model_info import model_params, resolve_model_files

        files = resolve_model_files(args.tokenizer, args.model_dir)
        params = model_params(files)
        if not params:
            return None
        weight_bytes = params * DTYPE_BYTES[args.floor_dtype]
    return {
        "weight_bytes": weight_bytes,
        "bandwidth_gbs": bandwidth_gbs,
        "floor_ms": weight_bytes / (bandwidth_gbs * 1e9) * 1e3,
    }


if __name__ == "__main__":
    sys.exit(main())
