"""`python -m sonar bench throughput`: offline throughput through the library (`sonar.open()`).

All requests of the dataset are submitted at once to an engine in this process (continuous
batching decides how many run together); each generates exactly its output length (EOS is
ignored, greedy sampling). Reports elapsed time, requests/s and input/output/total tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio

from sonar.bench.datasets import add_dataset_arguments, dataset_args, sample_requests


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sonar bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="model path or cached id (default: the embedded SmolLM2)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--max-model-len", default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", default=None, help="KV cache size, e.g. 256M or 2G")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--placement", default=None, help="e.g. worker=process")
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other engine argument of sonar.open() (JSON values), repeatable",
    )
    add_dataset_arguments(p)
    p.add_argument("--output-json", default=None, help="write the result as JSON to this file")
    return p


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `sonar.open()` keyword arguments the flags ask for."""
    out: dict[str, Any] = {"dtype": args.dtype, "seed": args.seed}
    for key in (
        "tokenizer",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_memory_bytes",
        "placement",
    ):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.enforce_eager:
        out["enforce_eager"] = True
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg takes KEY=VALUE, not {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            out[key.replace("-", "_")] = value
    return out


async def run_throughput(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Start the engine, run the dataset through it, and return the figures."""
    import sonar

    started = time.perf_counter()
    async with sonar.open(args.model, **engine_args(args)) as llm:
        ready = time.perf_counter() - started
        samples = await anyio.to_thread.run_sync(sample_requests, dataset_args(args), llm.tokenizer)
        log(f"bench throughput: engine ready in {ready:.1f} s; {len(samples)} requests ({args.dataset_name})")
        outputs: list[Any] = [None] * len(samples)

        async def one(i: int) -> None:
            schema = samples[i].json_schema
            params = sonar.SamplingParams(
                max_tokens=samples[i].expected_output_len,
                temperature=0.0,
                # A grammar ends the request where the JSON ends: EOS must then stop it.
                ignore_eos=schema is None,
                structured_outputs=None if schema is None else sonar.StructuredOutputsParams(json=schema),
            )
            outputs[i] = await llm.generate(samples[i].prompt, params)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(samples)):
                tg.start_soon(one, i)
        elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "engine_args": {k: v for k, v in engine_args(args).items()},
        "dataset_name": args.dataset_name,
        "num_requests": len(samples),
        "startup_seconds": ready,
        "elapsed_time": elapsed,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(samples) / elapsed,
        "input_tokens_per_second": prompt_tokens / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
    }


def format_report(r: dict[str, Any]) -> str:
    width = 50
    rows = [
        ("Requests:", r["num_requests"]),
        ("Elapsed time (s):", f"{r['elapsed_time']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total output tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['requests_per_second']:.2f}"),
        ("Input token throughput (tok/s):", f"{r['input_tokens_per_second']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_tokens_per_second']:.2f}"),
        ("Total token throughput (tok/s):", f"{r['tokens_per_second']:.2f}"),
        ("Engine startup (s):", f"{r['startup_seconds']:.2f}"),
    ]
    lines = [" Offline Throughput Result ".center(width, "=")]
    lines += [f"{name:<40} {value}" for name, value in rows]
    lines.append("=" * width)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = anyio.run(run_throughput, args, backend="asyncio")
    except (ValueError, TypeError) as exc:
        print(f"bench throughput: {exc}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"bench throughput: result written to {path}")
    return 0
