"""`python -m sonar bench collectives`: what a tensor-parallel decode step spends in collectives.

Starts ``--tp`` rank processes on this machine, joined into a torch.distributed group exactly as
the engine's ranks are (`sonar.engine.ranks`: gloo on loopback, each rank pinned to its share of
the cores), and times the collectives one decode step of a model makes at ``--rows`` sequences:
two all-reduces of ``[rows, hidden]`` per layer, one all-gather of the ``[rows, vocab / tp]``
logits and one broadcast of the sampled ids. The model's shapes come from its config (default:
the embedded SmolLM2-135M: 30 layers, hidden 576, vocabulary 49152). No model weights, no math
between the calls: this is the floor collectives put under a step, to set against its whole time
(`sonar bench throughput --engine-arg tensor_parallel_size=N`).

usage: python -m sonar bench collectives [--tp 2] [--rows 1,16] [--dtype bfloat16] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench collectives",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tp", type=int, default=2, help="ranks in the group (default 2)")
    p.add_argument("--rows", default="1,16", help="decode batch sizes, comma-separated (default 1,16)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--steps", type=int, default=50, help="timed steps per batch size (default 50)")
    p.add_argument("--model", default=None, help="model whose shapes to use (default: the embedded SmolLM2)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    return p


def model_shape(model: str | None) -> dict[str, int]:
    """Layers, hidden size and vocabulary of `model`'s config.json (no weights are read)."""
    from sonar.bench.model_info import read_config, resolve_model_files

    files = resolve_model_files(None, model)
    config = read_config(files.config_dir)
    if config is None:
        raise SystemExit(f"bench collectives: no config.json found for {files.note}")
    return {"layers": config["num_hidden_layers"], "hidden": config["hidden_size"], "vocab": config["vocab_size"]}


def rank_main(args: argparse.Namespace) -> None:
    """One rank: join, warm up, time each batch size's steps; rank 0 prints one JSON line per size."""
    import torch

    from sonar.engine import ranks

    shape = json.loads(args.shape)
    cores = ranks.pin_to_cores(args.rank, args.tp)
    topology = ranks.join(None, ranks.LOOPBACK, args.port, args.rank, args.tp, 1, torch.device("cpu"), 120)
    tp = topology.tp
    dtype = getattr(torch, args.dtype)
    vocab_rows, _ = tp.vocab_rows(shape["vocab"])
    for rows in [int(r) for r in args.rows.split(",")]:
        hidden = torch.randn(rows, shape["hidden"], dtype=dtype)
        logits = torch.randn(rows, vocab_rows, dtype=dtype)
        sampled = torch.zeros(rows, dtype=torch.int64)
        timings: dict[str, list[float]] = {"all_reduce": [], "all_gather": [], "broadcast": [], "step": []}
        for step in range(args.steps + 5):
            t0 = time.perf_counter()
            for _ in range(2 * shape["layers"]):
                tp.all_reduce(hidden)
            t1 = time.perf_counter()
            tp.gather_last(logits)
            t2 = time.perf_counter()
            topology.share_tokens(sampled)
            t3 = time.perf_counter()
            if step >= 5:  # the first steps set up gloo's buffers
                timings["all_reduce"].append((t1 - t0) / (2 * shape["layers"]))
                timings["all_gather"].append(t2 - t1)
                timings["broadcast"].append(t3 - t2)
                timings["step"].append(t3 - t0)
        if tp.leader:
            medians = {k: statistics.median(v) * 1e3 for k, v in timings.items()}
            print(json.dumps({"rows": rows, "cores_per_rank": len(cores), **medians}), flush=True)
    ranks.leave()  # before exiting: gloo's threads must not outlive the interpreter


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    import torch.distributed as dist

    shape = model_shape(args.model)
    store = dist.TCPStore("127.0.0.1", 0, args.tp + 1, is_master=True, wait_for_workers=False)
    common = ["--tp", str(args.tp), "--rows", args.rows, "--dtype", args.dtype, "--steps", str(args.steps)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sonar.bench.collectives", *common, "--rank", str(rank), "--port", str(store.port),
             "--shape", json.dumps(shape)],
            stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
            text=True,
        )
        for rank in range(args.tp)
    ]  # fmt: skip
    out, _ = procs[0].communicate()
    codes = [procs[0].returncode] + [p.wait() for p in procs[1:]]
    if any(codes):
        print(f"bench collectives: a rank failed (exit codes {codes})", file=sys.stderr)
        return 1
    results: list[dict[str, Any]] = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(
        f"tensor parallelism {args.tp} on gloo ({args.dtype}), shapes of {args.model or 'the embedded SmolLM2'}: "
        f"{shape['layers']} layers, hidden {shape['hidden']}, vocabulary {shape['vocab']}"
    )
    print("| rows | cores/rank | all-reduce (ms) | x per step | all-gather (ms) | broadcast (ms) | per step (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['rows']} | {r['cores_per_rank']} | {r['all_reduce']:.3f} | {2 * shape['layers']} | "
            f"{r['all_gather']:.3f} | {r['broadcast']:.3f} | {r['step']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
