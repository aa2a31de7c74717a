"""What the server's Prometheus `/metrics` says before, during and after a benchmark.

Sonar prefixes its metrics with `sonar:`, vLLM with `vllm:`; both are read, under the name
without the prefix. Older vLLM names (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`) are mapped
to the current ones. A server without `/metrics` simply yields no server-side figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from sonar.procfs import resident_bytes

PREFIXES = ("sonar:", "vllm:")
ALIASES = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "gpu_prefix_cache_queries_total": "prefix_cache_queries_total",
    "gpu_prefix_cache_hits_total": "prefix_cache_hits_total",
}
RSS = "process_resident_memory_bytes"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (prefix stripped, histogram buckets left out) -> value summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith(("_bucket", "_created")):
                continue
            for prefix in PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            name = ALIASES.get(name, name)
            out[name] = out.get(name, 0.0) + float(sample.value)
    return out


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The server's metrics now, or None if it has no readable `/metrics`."""
    try:
        response = await client.get(f"{base_url}/metrics", timeout=10)
        if response.status_code != 200:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


@dataclass
class MetricsPoller:
    """Polls `/metrics` every `interval` seconds while a benchmark runs and keeps the peaks."""

    client: httpx.AsyncClient
    base_url: str
    interval: float = 0.5
    server_pid: int | None = None
    peak_kv_usage: float | None = None
    peak_rss: float | None = None
    peak_running: float | None = None
    samples: list[tuple[float, float | None, float | None]] = field(default_factory=list)

    def observe(self, metrics: dict[str, float] | None) -> None:
        kv = rss = None
        if metrics:
            kv = metrics.get("kv_cache_usage_perc")
            rss = metrics.get(RSS)
            running = metrics.get("num_requests_running")
            if running is not None:
                self.peak_running = max(self.peak_running or 0.0, running)
        if rss is None and self.server_pid is not None:
            rss = resident_bytes(self.server_pid)
        if kv is not None:
            self.peak_kv_usage = max(self.peak_kv_usage or 0.0, kv)
        if rss is not None:
            self.peak_rss = max(self.peak_rss or 0.0, rss)
        self.samples.append((time.perf_counter(), kv, rss))

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            self.observe(await scrape(self.client, self.base_url))
            await anyio.sleep(self.interval)


def with_rss(metrics: dict[str, float] | None, server_pid: int | None) -> dict[str, float] | None:
    """`metrics` with the process memory of `server_pid` filled in where the server does not export it."""
    if server_pid is None or (metrics is not None and RSS in metrics):
        return metrics
    rss = resident_bytes(server_pid)
    if rss is None:
        return metrics
    return {**(metrics or {}), RSS: float(rss)}


def server_summary(
    before: dict[str, float] | None, after: dict[str, float] | None, poller: MetricsPoller
) -> dict[str, Any]:
    """The server-side figures of a run: peak KV usage, preemptions and prefix-cache hit rate over
    the run (differences of the counters), and process memory before, at peak and after."""
    b, a = before or {}, after or {}

    def delta(name: str) -> float | None:
        return a[name] - b.get(name, 0.0) if name in a else None

    queries, hits = delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total")
    peak_kv = poller.peak_kv_usage
    if "kv_cache_usage_perc" in a:
        peak_kv = max(peak_kv or 0.0, a["kv_cache_usage_perc"])
    peak_rss = max((v for v in (poller.peak_rss, a.get(RSS)) if v is not None), default=None)
    return {
        "metrics_available": "kv_cache_usage_perc" in a or "num_requests_running" in a,
        "peak_kv_cache_usage": peak_kv,
        "num_preemptions": delta("num_preemptions_total"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "peak_running_requests": poller.peak_running,
        "rss_bytes_before": b.get(RSS),
        "rss_bytes_after": a.get(RSS),
        "rss_bytes_peak": peak_rss,
    }
