"""`python -m sonar bench serve`: load a running OpenAI-compatible server (Sonar, vLLM, ...) and
report what its users see.

Requests are streamed; arrivals follow a Poisson process at ``--request-rate`` (gamma-distributed
gaps with shape ``--burstiness``; ``inf`` sends everything at once), at most
``--max-concurrency`` in flight. The report gives completed/failed requests, request and token
throughput, TTFT/TPOT/ITL/E2EL statistics, goodput under ``--goodput`` SLOs, the server's own
figures from ``/metrics`` (peak KV cache usage, preemptions, prefix-cache hit rate, process
memory) and the physical floor of a decode step at the run's mean batch (at the memory bandwidth
measured here after the run when the server is on this machine: `sonar.bench.floor`). Flag names
follow ``vllm bench serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from sonar.actors.host import is_loopback
from sonar.bench.bandwidth import read_bandwidth_gbs
from sonar.bench.datasets import SampleRequest, add_dataset_arguments, dataset_args, sample_requests
from sonar.bench.endpoint import BACKENDS, RequestResult, send_request
from sonar.bench.floor import add_floor_arguments, floor_from_args, format_floor, missing_floor
from sonar.bench.model_info import load_tokenizer, model_params, resolve_model_files
from sonar.bench.server_metrics import MetricsPoller, scrape, server_summary, with_rss
from sonar.bench.stats import (
    LABELS,
    finite,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)

DEFAULT_PORT = 2242


def add_serve_arguments(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """The flags of `bench serve` (without the address flags when `server` is False: `bench sweep`
    starts its own servers)."""
    if server:
        g = parser.add_argument_group("server")
        g.add_argument("--base-url", default=None, help="the server's URL (default http://HOST:PORT)")
        g.add_argument("--host", default="127.0.0.1")
        g.add_argument("--port", type=int, default=DEFAULT_PORT)
        g.add_argument(
            "--server-pid",
            type=int,
            default=None,
            help="a local server's process id, to read its memory when /metrics does not export it",
        )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="openai",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions",
    )
    parser.add_argument("--endpoint", default=None, help="the API path (default: the backend's)")
    parser.add_argument("--model", default=None, help="the model name to request (default: the server's first model)")
    parser.add_argument("--served-model-name", default=None, help="the name sent in requests, if not --model")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapter names the server serves: each request asks for one of them, picked at random (--seed)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a local tokenizer directory or cached Hugging Face id (default: the model's, "
        "else the embedded SmolLM2's)",
    )
    add_dataset_arguments(parser)
    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson arrivals); inf sends all at once",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier"
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--ignore-eos", action="store_true", help="ask the server to generate all max_tokens")
    g.add_argument(
        "--no-stream",
        action="store_true",
        help="ask for each answer whole (stream false): TTFT is then its whole latency, TPOT that over its tokens",
    )
    g.add_argument("--num-warmups", type=int, default=0, help="requests sent and not counted before the run")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    g = parser.add_argument_group("report")
    g.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS"
    )
    g.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="which metrics get percentiles (ttft, tpot, itl, e2el)",
    )
    g.add_argument("--metric-percentiles", default="90,99", help="which percentiles, e.g. 50,90,99")
    g.add_argument("--metrics-interval", type=float, default=0.5, help="seconds between /metrics polls")
    g.add_argument("--save-result", action="store_true", help="write the result as JSON")
    g.add_argument("--result-dir", default=None, help="where --save-result writes (default .)")
    g.add_argument("--result-filename", default=None, help="the JSON file's name (default: generated)")
    g.add_argument("--label", default=None, help="a name for this run in the report and the file")
    g.add_argument(
        "--plot", default=None, metavar="FILE.png", help="write latency distributions and tokens/s over time as a PNG"
    )
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_floor_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sonar bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serve_arguments(parser)
    return parser


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests: gamma gaps with mean 1/rate (0 for inf)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)]


async def _models(client: httpx.AsyncClient, base_url: str) -> list[dict[str, Any]]:
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=30)
        response.raise_for_status()
        return list(response.json().get("data") or [])
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"cannot list the models of {base_url}: {exc}") from exc


async def run_serve(
    args: argparse.Namespace, base_url: str | None = None, log: Any = print
) -> tuple[dict[str, Any], list[RequestResult], float]:
    """Run the benchmark described by `args`; (the result dict, per-request results, start time)."""
    base_url = (base_url or args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or BACKENDS[args.backend]
    percentiles = parse_percentiles(args.metric_percentiles)
    metric_names = parse_metric_names(args.percentile_metrics)
    slos = parse_goodput(args.goodput)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = await _models(client, base_url)
        model = args.model or (models[0]["id"] if models else None)
        if model is None:
            raise RuntimeError(f"{base_url} serves no model; pass --model")
        root = next((m.get("root") for m in models if m.get("id") == model), None)
        files = resolve_model_files(args.tokenizer, args.tokenizer or args.model, root, model)
        tokenizer = await asyncio.to_thread(load_tokenizer, files.tokenizer_dir)
        samples = await asyncio.to_thread(sample_requests, dataset_args(args), tokenizer)
        request_model = args.served_model_name or model
        url = base_url + endpoint
        log(
            f"bench serve: {len(samples)} requests ({args.dataset_name}) to {url}, model {request_model}, "
            f"tokenizer {files.note}"
        )

        if args.num_warmups > 0:
            log(f"bench serve: {args.num_warmups} warm-up request(s)")
            # Drawn with another seed, so that warm-up prompts do not seed the prefix cache for the run.
            warm_args = dataclasses.replace(dataset_args(args), seed=args.seed + 1, num_prompts=args.num_warmups)
            warm_samples = await asyncio.to_thread(sample_requests, warm_args, tokenizer)
            warm = await asyncio.gather(
                *(
                    send_request(
                        client, url, args.backend, request_model, s, args.ignore_eos, stream=not args.no_stream
                    )
                    for s in warm_samples
                )
            )
            if not any(r.success for r in warm):
                raise RuntimeError(f"every warm-up request failed: {warm[0].error}")

        before = with_rss(await scrape(client, base_url), args_server_pid(args))
        poller = MetricsPoller(client, base_url, args.metrics_interval, args_server_pid(args))
        poll_task = asyncio.create_task(poller.run())
        results, t0, duration = await _run_requests(client, url, args, request_model, samples)
        poll_task.cancel()
        try:
            await poll_task
        except asyncio.CancelledError:
            pass
        after = with_rss(await scrape(client, base_url), args_server_pid(args))

    summary = summarize(results, duration, percentiles, slos, t0)
    server = server_summary(before, after, poller)
    params = None if args.model_params else await asyncio.to_thread(model_params, files)
    measured = None
    if not args.peak_bandwidth_gbs and (args.model_params or params) and is_loopback(base_url):
        measured = await asyncio.to_thread(read_bandwidth_gbs)  # the server is idle now
    floor = floor_from_args(args, params, summary["mean_concurrency"], summary["mean_tpot_ms"] or None, measured)
    ok = [r for r in results if r.success]
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "label": args.label,
        "base_url": base_url,
        "endpoint": endpoint,
        "backend": args.backend,
        "model_id": request_model,
        "lora_modules": getattr(args, "lora_modules", None),
        "tokenizer": str(files.tokenizer_dir),
        "dataset_name": args.dataset_name,
        "num_prompts": len(samples),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "stream": not args.no_stream,
        "seed": args.seed,
        "percentile_metrics": metric_names,
        "metric_percentiles": percentiles,
        **summary,
        "server": server,
        "floor": floor.to_dict() if floor else None,
        "floor_missing": None if floor else missing_floor(args.model_params or params),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency for r in results],
        "start_times": [r.start - t0 for r in results],
        "errors": [r.error for r in results],
    }
    if not ok and results:
        log(f"bench serve: every request failed; the first error: {results[0].error}")
    return {k: finite(v) for k, v in result.items()}, results, t0


def args_server_pid(args: argparse.Namespace) -> int | None:
    return getattr(args, "server_pid", None)


async def _run_requests(
    client: httpx.AsyncClient, url: str, args: argparse.Namespace, model: str, samples: Sequence[SampleRequest]
) -> tuple[list[RequestResult], float, float]:
    """Send every sample on its arrival schedule; (results in sample order, start, duration)."""
    from tqdm import tqdm

    delays = arrival_delays(len(samples), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="requests", unit="req")

    adapters = getattr(args, "lora_modules", None)
    pick = random.Random(args.seed)
    models = [pick.choice(adapters) for _ in samples] if adapters else [model] * len(samples)

    async def one(sample: SampleRequest, model: str) -> RequestResult:
        stream = not args.no_stream
        if limit is None:
            result = await send_request(client, url, args.backend, model, sample, args.ignore_eos, stream=stream)
        else:
            async with limit:
                result = await send_request(client, url, args.backend, model, sample, args.ignore_eos, stream=stream)
        bar.update(1)
        return result

    tasks: list[asyncio.Task[RequestResult]] = []
    t0 = time.perf_counter()
    try:
        for sample, delay, name in zip(samples, delays, models):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample, name)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        bar.close()
    return results, t0, time.perf_counter() - t0


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_report(result: dict[str, Any]) -> str:
    """The result as a table in the style of `vllm bench serve`."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<40} {_fmt(value, digits):<10}")

    def section(title: str) -> None:
        lines.append(title.center(width, "-"))

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["peak_output_throughput"])
    row("Peak concurrent requests:", result["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in result["percentile_metrics"]:
        label = LABELS[name]
        section(titles[name])
        row(f"Mean {label} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", result[f"median_{name}_ms"])
        for p in result["metric_percentiles"]:
            row(f"P{p:g} {label} (ms):", result[f"p{p:g}_{name}_ms"])
    server = result.get("server") or {}
    section("Server (/metrics)")
    if not server.get("metrics_available") and server.get("rss_bytes_peak") is None:
        lines.append("no /metrics figures from this server")
    else:
        kv = server.get("peak_kv_cache_usage")
        row("Peak KV cache usage (%):", kv * 100 if kv is not None else None, 1)
        row("Preemptions:", _int(server.get("num_preemptions")))
        hit = server.get("prefix_cache_hit_rate")
        row("Prefix cache hit rate (%):", hit * 100 if hit is not None else None, 1)
        row("Peak running requests:", _int(server.get("peak_running_requests")))
        for key, name in (("rss_bytes_before", "before"), ("rss_bytes_peak", "peak"), ("rss_bytes_after", "after")):
            v = server.get(key)
            row(f"Server memory {name} (MiB):", v / 2**20 if v is not None else None, 0)
    section("Physical floor (one decode step)")
    floor = result.get("floor")
    if floor:
        from sonar.bench.floor import Floor

        lines.extend(format_floor(Floor(**floor)))
    else:
        lines.append(result["floor_missing"])
    lines.append("=" * width)
    return "\n".join(lines)


def _int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """Where --save-result writes: --result-dir / (--result-filename or a generated name)."""
    name = args.result_filename
    if not name:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = str(result.get("model_id") or "model").replace("/", "_")
        name = f"{args.label or args.backend}-{result['request_rate']}qps{conc}-{model}-{stamp}.json"
    return Path(args.result_dir or ".") / name


def save_result(path: Path, result: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result, results, t0 = asyncio.run(run_serve(args))
    except (RuntimeError, ValueError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.save_result:
        print(f"bench serve: result written to {save_result(result_path(args, result), result)}")
    if args.plot:
        from sonar.bench.plot import plot_serve

        title = f"{result['model_id']} {result['dataset_name']}, {result['num_prompts']} requests"
        print(f"bench serve: plot written to {plot_serve(results, t0, args.plot, title)}")
    return 0 if result["completed"] > 0 else 1
