"""Time to first token: a long prefix loaded back from the CPU offload tier vs recomputed.

Starts `python -m sonar serve` (the embedded SmolLM2-135M-Instruct) with a primary KV cache just
big enough for one request and a CPU tier, then, for each of `--rounds` distinct prompts of
`--prefix-len` random tokens plus a `--suffix-len` tail:

1. sends the prompt (nothing cached: the whole prefix is computed) and times its first token;
2. sends two other prompts of the same length, which evict it from the primary cache (the
   evicted blocks were stored in the CPU tier when the first request finished);
3. sends the same prompt again: its prefix now comes back from the CPU tier; times its first
   token and checks that the output is the same.

Prints one line per round and the medians, plus the server's tier metrics, as Markdown.

    python scripts/bench_kv_offload.py --rounds 5 --prefix-len 1500
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sonar.bench.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def ttft(base: str, prompt: list[int], max_tokens: int) -> tuple[float, str, int]:
    """Seconds to the first streamed token, the whole text, and the cached prompt tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    text = ""
    cached = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - started
            for choice in chunk.get("choices") or []:
                text += choice.get("text", "")
            usage = chunk.get("usage")
            if usage and usage.get("prompt_tokens_details"):
                cached = usage["prompt_tokens_details"].get("cached_tokens", 0)
    assert first is not None
    return first, text, cached


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def metric_lines(base: str) -> list[str]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    keep = ("sonar:kv_offload_hit_blocks_total", "sonar:kv_offload_loads_total",
            "sonar:kv_offload_load_latency_seconds_sum",
            "sonar:kv_offload_load_latency_seconds_count", "sonar:external_prefix_cache_hits_total")
    return [line for line in text.splitlines() if line.startswith(keep) and 'medium="DISK"' not in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-gib", type=float, default=2.0)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]

    total = args.prefix_len + args.suffix_len
    max_len = (total + args.max_tokens + BLOCK) // BLOCK * BLOCK
    blocks = max_len // BLOCK  # exactly one request fits the primary cache
    port = free_port()
    cmd = [sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(max_len), "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", "1",
           "--enable-prompt-tokens-details", "--kv-offloading-size", str(args.cpu_gib), "--disable-log-stats"]
    print("server:", " ".join(cmd[1:]), file=sys.stderr)
    log_path = Path(tempfile.gettempdir()) / f"sonar-bench-kv-offload-{port}.log"
    print("server log:", log_path, file=sys.stderr)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        rng = random.Random(0)

        def prompt() -> list[int]:
            return [rng.randrange(1000, 40000) for _ in range(total)]

        ttft(base, prompt(), 1)  # warm up (first-request costs)
        rows = []
        for i in range(args.rounds):
            p = prompt()
            cold, cold_text, cold_cached = ttft(base, p, args.max_tokens)
            time.sleep(0.3)
            for _ in range(2):
                ttft(base, prompt(), 1)
                time.sleep(0.3)
            warm, warm_text, warm_cached = ttft(base, p, args.max_tokens)
            rows.append((cold, warm, cold_cached, warm_cached, cold_text == warm_text))
            print(f"round {i}: recomputed {cold * 1000:.0f} ms (cached {cold_cached}), from CPU tier "
                  f"{warm * 1000:.0f} ms (cached {warm_cached}), same output: {cold_text == warm_text}",
                  file=sys.stderr)
        metrics = metric_lines(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

    cold_med = statistics.median(r[0] for r in rows)
    warm_med = statistics.median(r[1] for r in rows)
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs ({cpu_model()}), Python "
          f"{platform.python_version()}; 1-minute load average {load_before:.2f} before the run\n")
    print("| round | prompt tokens | TTFT recomputed (ms) | TTFT from CPU tier (ms) | cached tokens (tier) "
          "| same output |")
    print("|---|---|---|---|---|---|")
    for i, (cold, warm, _, warm_cached, same) in enumerate(rows):
        print(f"| {i} | {total} | {cold * 1000:.0f} | {warm * 1000:.0f} | {warm_cached} | {'yes' if same else 'NO'} |")
    print(f"| median | {total} | {cold_med * 1000:.0f} | {warm_med * 1000:.0f} | | |")
    print(f"\nSpeed-up of the median TTFT: {cold_med / warm_med:.1f}x\n")
    print("```")
    print("\n".join(metrics))
    print("```")
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
