"""The server's observability: Prometheus `/metrics`, `/load`, and the periodic stats log line.

`ServerMetrics` owns one `CollectorRegistry` per app (never prometheus_client's global one, so
several apps in one process do not collide). The metric names mirror vLLM's, with the `sonar:`
prefix:

- per-request, recorded by the completion and chat handlers through a `RequestRecorder` (one per
  HTTP request; `track()` wraps the engine's delta stream and calls it at each output):
  `sonar:prompt_tokens_total`, `sonar:generation_tokens_total`,
  `sonar:request_success_total{finished_reason}`, and the histograms
  `sonar:time_to_first_token_seconds`, `sonar:inter_token_latency_seconds`,
  `sonar:e2e_request_latency_seconds`, `sonar:request_queue_time_seconds`;
- engine-side, read from `llm.stats()` when `/metrics` is scraped (a custom collector: the engine
  keeps the counts, nothing here increments them): `sonar:num_requests_running`,
  `sonar:num_requests_waiting`, `sonar:kv_cache_usage_perc`, `sonar:num_preemptions_total`,
  `sonar:prefix_cache_queries_total`, `sonar:prefix_cache_hits_total`, `sonar:engine_steps_total`
  (with a vision model also `sonar:mm_encoder_runs_total`, `sonar:mm_encoder_cache_hits_total`:
  images through the tower, images from the worker's encoder cache); with data parallelism, one
  series per replica, labelled `engine` with its index as vLLM labels its engines
  (`llm.replica_stats()`);
- `sonar:requests_tracked{actor}`: requests the frontend, the scheduler and the detokenizer hold
  state for (`llm.tracked_requests()`; all 0 when idle, anything else is a leak);
- from the supervision tree (`llm.tree()`): `sonar:actor_restarts_total{actor}`,
  `sonar:actor_mailbox_depth{actor}` and `sonar:actor_resident_memory_bytes{actor}` (actors in
  other processes; a data-parallel replica's actors are named under it, `replica1/worker`); the server process's own `process_resident_memory_bytes` and friends come
  from prometheus_client's `ProcessCollector`;
- with KV offloading, from the scheduler's stats: `sonar:num_requests_waiting_for_kv`,
  `sonar:external_prefix_cache_queries_total` / `sonar:external_prefix_cache_hits_total` (prompt
  tokens looked up, and loaded back from the offload tiers); and from the offload manager
  (`GetOffloadStats`, asked at scrape time), per tier (`medium` CPU or DISK):
  `sonar:kv_offload_capacity_bytes`, `sonar:kv_offload_used_bytes`, `sonar:kv_offload_chunks`,
  `sonar:kv_offload_stores_total`, `sonar:kv_offload_store_bytes_total`,
  `sonar:kv_offload_loads_total`, `sonar:kv_offload_load_bytes_total`,
  `sonar:kv_offload_hit_blocks_total`, `sonar:kv_offload_evictions_total`,
  `sonar:kv_offload_corrupt_chunks_total`, `sonar:kv_offload_foreign_chunks_total`,
  `sonar:kv_offload_write_errors_total`, `sonar:kv_offload_degraded` (1 while a tier takes no
  writes after one failed), and the histogram `sonar:kv_offload_load_latency_seconds` (by the
  slowest tier a load read from); with KV events, `sonar:kv_events_dropped_total`;
- with --kv-cache-metrics, from the scheduler's stats, the histograms
  `sonar:kv_block_lifetime_seconds`, `sonar:kv_block_idle_before_evict_seconds`,
  `sonar:kv_block_reuse_gap_seconds` (`sonar.core.kv_residency`); with --enable-mfu-metrics
  (`sonar.core.flops`), `sonar:estimated_flops_per_gpu_total`,
  `sonar:estimated_read_bytes_per_gpu_total`, `sonar:model_busy_seconds_total` and, where the
  device's peak is known, `sonar:peak_flops_per_gpu` and `sonar:model_flops_utilization`.

With --otlp-traces-endpoint the `RequestRecorder` also ends each described request's spans
(`sonar.http.tracing`).

With `--api-server-count N` > 1 every API server process records its per-request series (and its
`/load` count) in a directory the `serve` process shares with them (prometheus_client's
multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`): whichever server answers, `/metrics` shows the
counters and histograms summed over all of them (those of a server process that died included:
its files stay, and its restarted process writes new ones under its new pid) and `/load` the
requests in flight on the live ones. The engine-side series come from the engine, once; the
``process_*`` series and the frontend's `requests_tracked` are the answering process's.

A "request" in the histograms and in `request_success_total` is one engine request: one
completion choice (an HTTP request with `n=2` and two prompts is four). Prompt tokens count each
prompt once, as the responses' usage does.
"""

from __future__ import annotations

import glob
import itertools
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

from sonar.actors.tree import ActorInfo
from sonar.core.kv_residency import RESIDENCY_BUCKETS
from sonar.core.outputs import RequestModelTime, RequestTiming, StepRef
from sonar.engine.llm import LLM, RequestOutput, StreamDelta
from sonar.http.protocol import PerRequestMetrics
from sonar.http.tracing import RequestTracer, SpanTimes, span_attributes
from sonar.log import get_logger
from sonar.procfs import resident_bytes

log = get_logger("sonar.stats")

#: The routes whose requests count toward `/load` (vLLM counts its generation endpoints).
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})

# Buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _EngineCollector(Collector):
    """Engine-side gauges and counters from the last `llm.stats()` and `llm.tree()` snapshot.

    `collect()` is synchronous, so `/metrics` takes the snapshot (an ask to the scheduler) first
    and then renders; a scrape whose stats ask failed leaves the engine metrics out."""

    def __init__(self) -> None:
        self.stats: list[Any] | None = None
        """The scheduler's stats: one engine's, or each data-parallel replica's (None: it did not
        answer), whose series then carry an ``engine`` label (the replica's index)."""
        self.tree: ActorInfo | None = None
        self.tracked: dict[str, int] | None = None
        self.offload: Any = None
        """The offload manager's `OffloadStats` (None: no manager, or its ask failed)."""
        self.offloading = False
        """The engine offloads KV (the external prefix cache metrics apply)."""
        self.speculating = False
        """The engine decodes speculatively (the ``spec_decode`` metrics apply)."""
        self.max_loras = 0
        """The engine's LoRA slots (0: LoRA is off, no ``lora_requests_info``)."""
        self.vision = False
        """The model takes images (the ``mm_encoder`` metrics apply)."""

    def collect(self) -> Iterator[Any]:
        if self.stats is not None:
            yield from self._engine_metrics(self.stats)
        if self.offload is not None:
            yield from _offload_metrics(self.offload)
        if self.tracked is not None:
            tracked = GaugeMetricFamily(
                "sonar:requests_tracked",
                "Requests each part of the server holds state for (0 when idle).",
                labels=["actor"],
            )
            for actor, count in self.tracked.items():
                tracked.add_metric([actor], count)
            yield tracked
        if self.tree is not None:
            restarts = CounterMetricFamily(
                "sonar:actor_restarts", "Restarts of each actor of the engine tree.", labels=["actor"]
            )
            depth = GaugeMetricFamily(
                "sonar:actor_mailbox_depth", "Messages waiting in each actor's mailbox.", labels=["actor"]
            )
            memory = GaugeMetricFamily(
                "sonar:actor_resident_memory_bytes",
                "Resident memory of each actor process other than the server's own.",
                labels=["actor"],
            )
            for name, node in _walk(self.tree):
                restarts.add_metric([name], node.restarts)
                if node.mailbox_depth is not None:
                    depth.add_metric([name], node.mailbox_depth)
                if node.kind == "actor" and node.pid and node.pid != os.getpid():
                    rss = resident_bytes(node.pid)
                    if rss is not None:
                        memory.add_metric([name], rss)
            yield restarts
            yield depth
            yield memory

    def _engine_metrics(self, stats: list[Any]) -> Iterator[Any]:
        """The scheduler's gauges and counters: unlabelled for one engine, else one series per
        replica that answered, labelled ``engine`` as vLLM labels its engines."""
        labelled = len(stats) > 1
        series = [(str(i), s) for i, s in enumerate(stats) if s is not None]
        families = [
            (GaugeMetricFamily, "sonar:num_requests_running", "Requests in the engine's running batch.", "num_running"),
            (GaugeMetricFamily, "sonar:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            (GaugeMetricFamily, "sonar:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_usage"),
            (CounterMetricFamily, "sonar:num_preemptions", "Preemptions since the engine started.", "num_preemptions"),
            (
                CounterMetricFamily,
                "sonar:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                "prefix_queries",
            ),
            (
                CounterMetricFamily,
                "sonar:prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                "prefix_hits",
            ),
            (CounterMetricFamily, "sonar:engine_steps", "Engine steps run since start.", "num_steps"),
        ]
        if self.vision:
            families += [
                (
                    CounterMetricFamily,
                    "sonar:mm_encoder_runs",
                    "Images run through the vision tower.",
                    "mm_encoder_runs",
                ),
                (
                    CounterMetricFamily,
                    "sonar:mm_encoder_cache_hits",
                    "Images whose feature rows came from the worker's encoder cache.",
                    "mm_encoder_cache_hits",
                ),
            ]
        if self.offloading:
            families += [
                (
                    GaugeMetricFamily,
                    "sonar:num_requests_waiting_for_kv",
                    "Requests waiting for their prefix to be loaded from the offload tiers.",
                    "num_loading",
                ),
                (
                    CounterMetricFamily,
                    "sonar:external_prefix_cache_queries",
                    "Prompt tokens looked up in the prefix cache (and the offload tiers).",
                    "prefix_queries",
                ),
                (
                    CounterMetricFamily,
                    "sonar:external_prefix_cache_hits",
                    "Prompt tokens loaded back from the offload tiers instead of recomputed.",
                    "offload_hits",
                ),
            ]
        if self.speculating:
            families += [
                (
                    CounterMetricFamily,
                    "sonar:spec_decode_num_drafts",
                    "Steps of a request that carried speculative drafts.",
                    "spec_num_drafts",
                ),
                (
                    CounterMetricFamily,
                    "sonar:spec_decode_num_draft_tokens",
                    "Draft tokens proposed.",
                    "spec_num_draft_tokens",
                ),
                (
                    CounterMetricFamily,
                    "sonar:spec_decode_num_accepted_tokens",
                    "Draft tokens accepted.",
                    "spec_num_accepted_tokens",
                ),
            ]
        for kind, name, doc, field in families:
            if not labelled:
                yield kind(name, doc, value=getattr(series[0][1], field))
                continue
            family = kind(name, doc, labels=["engine"])
            for engine, s in series:
                family.add_metric([engine], getattr(s, field))
            yield family
        if self.max_loras:
            # vLLM's shape (the adapters as label values, the time as the value): LoRA-aware
            # routers (the Gateway API inference extension) read it to place requests
            info = GaugeMetricFamily(
                "sonar:lora_requests_info",
                "The LoRA adapters of the running and the waiting requests (comma-separated), and the slots.",
                labels=(["engine"] if labelled else [])
                + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            )
            now = time.time()
            for engine, s in series:
                labels = [str(self.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras)]
                info.add_metric([engine, *labels] if labelled else labels, now)
            yield info
        if self.speculating:
            positions = CounterMetricFamily(
                "sonar:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each position of a step's drafts (0-based).",
                labels=["engine", "position"] if labelled else ["position"],
            )
            for engine, s in series:
                for position, count in enumerate(s.spec_accepted_per_position):
                    labels = [engine, str(position)] if labelled else [str(position)]
                    positions.add_metric(labels, count)
            yield positions
        if any(s.kv_residency is not None for _, s in series):
            yield from _residency_metrics(series, labelled)
        if any(s.mfu is not None for _, s in series):
            yield from _mfu_metrics(series, labelled)


_RESIDENCY = (
    ("lifetime", "sonar:kv_block_lifetime_seconds", "Sampled KV blocks: allocation to eviction."),
    (
        "idle_before_evict",
        "sonar:kv_block_idle_before_evict_seconds",
        "Sampled KV blocks: last reference dropped to eviction.",
    ),
    ("reuse_gap", "sonar:kv_block_reuse_gap_seconds", "Sampled KV blocks: time between consecutive accesses."),
)


def _residency_metrics(series: list[tuple[str, Any]], labelled: bool) -> Iterator[Any]:
    """--kv-cache-metrics: the scheduler's residency histograms (`sonar.core.kv_residency`)."""
    bounds = [*(str(b) for b in RESIDENCY_BUCKETS), "+Inf"]
    for field, name, doc in _RESIDENCY:
        family = HistogramMetricFamily(name, doc, labels=["engine"] if labelled else None)
        for engine, s in series:
            if s.kv_residency is None:
                continue
            hist = getattr(s.kv_residency, field)
            cumulative = list(itertools.accumulate(hist.counts))
            family.add_metric([engine] if labelled else [], list(zip(bounds, cumulative)), hist.total)
        yield family


_MFU = (
    (
        CounterMetricFamily,
        "sonar:estimated_flops_per_gpu",
        "Estimated model FLOPs of the steps run, per device.",
        "flops",
    ),
    (
        CounterMetricFamily,
        "sonar:estimated_read_bytes_per_gpu",
        "Estimated bytes the steps read (weights, KV cache), per device.",
        "read_bytes",
    ),
    (CounterMetricFamily, "sonar:model_busy_seconds", "Seconds the worker spent running steps.", "busy_seconds"),
)


def _mfu_metrics(series: list[tuple[str, Any]], labelled: bool) -> Iterator[Any]:
    """--enable-mfu-metrics (`sonar.core.flops`): the counters, the device's peak where known,
    and the utilization over the busy time since start."""
    measured = [(engine, s.mfu) for engine, s in series if s.mfu is not None]
    for kind, name, doc, field in _MFU:
        family = kind(name, doc, labels=["engine"] if labelled else None)
        for engine, mfu in measured:
            family.add_metric([engine] if labelled else [], getattr(mfu, field))
        yield family
    known = [(engine, mfu) for engine, mfu in measured if mfu.peak_flops > 0]
    if not known:
        return
    peak = GaugeMetricFamily(
        "sonar:peak_flops_per_gpu", "The device's peak FLOP/s Sonar assumes.", labels=["engine"] if labelled else None
    )
    mfu_gauge = GaugeMetricFamily(
        "sonar:model_flops_utilization",
        "Estimated FLOPs over busy seconds times the peak, since start (0..1).",
        labels=["engine"] if labelled else None,
    )
    for engine, mfu in known:
        labels = [engine] if labelled else []
        peak.add_metric(labels, mfu.peak_flops)
        busy = mfu.busy_seconds * mfu.peak_flops
        mfu_gauge.add_metric(labels, mfu.flops / busy if busy > 0 else 0.0)
    yield peak
    yield mfu_gauge


_TIER_GAUGES = (
    ("capacity_bytes", "sonar:kv_offload_capacity_bytes", "Bytes the offload tier may hold."),
    ("used_bytes", "sonar:kv_offload_used_bytes", "Bytes the offload tier holds."),
    ("chunks", "sonar:kv_offload_chunks", "Chunks the offload tier holds."),
    (
        "degraded",
        "sonar:kv_offload_degraded",
        "1 while the offload tier takes no writes after one failed (disk full, I/O error), else 0.",
    ),
)
_TIER_COUNTERS = (
    ("stores", "sonar:kv_offload_stores", "Chunks written into the offload tier."),
    ("store_bytes", "sonar:kv_offload_store_bytes", "Bytes written into the offload tier."),
    ("loads", "sonar:kv_offload_loads", "Chunks loaded back from the offload tier."),
    ("load_bytes", "sonar:kv_offload_load_bytes", "Bytes loaded back from the offload tier."),
    ("hit_blocks", "sonar:kv_offload_hit_blocks", "KV blocks of prompts served from the offload tier."),
    ("evictions", "sonar:kv_offload_evictions", "Chunks the offload tier evicted."),
    ("corrupt", "sonar:kv_offload_corrupt_chunks", "Damaged chunks found (dropped, never served)."),
    ("foreign", "sonar:kv_offload_foreign_chunks", "Chunk files of another model or layout (ignored)."),
    ("write_errors", "sonar:kv_offload_write_errors", "Chunk writes into the offload tier that failed."),
)


def _offload_metrics(stats: Any) -> Iterator[Any]:
    """The offload manager's `OffloadStats` as metric families, labelled by tier."""
    yield CounterMetricFamily(
        "sonar:kv_events_dropped", "KV event batches dropped, the publisher's queue full.", value=stats.events_dropped
    )
    if not stats.tiers:  # the manager only publishes events
        return
    for field, name, doc in _TIER_GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=["medium"])
        for tier in stats.tiers:
            gauge.add_metric([tier.medium], int(getattr(tier, field)))
        yield gauge
    for field, name, doc in _TIER_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["medium"])
        for tier in stats.tiers:
            counter.add_metric([tier.medium], getattr(tier, field))
        yield counter
    latency = HistogramMetricFamily(
        "sonar:kv_offload_load_latency_seconds",
        "Time to load a prefix from the offload tiers, by the slowest tier read.",
        labels=["medium"],
    )
    for medium, hist in sorted(stats.load_latency.items()):
        buckets, total = [], 0
        for bound, count in zip([*hist.bounds, float("inf")], hist.counts):
            total += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), total))
        latency.add_metric([medium], buckets, sum_value=hist.sum)
    yield latency


async def _offload_stats(llm: LLM, timeout: float) -> Any:
    """The offload manager's stats, or None (no manager, or it is restarting)."""
    from sonar.protocol.offload import GetOffloadStats

    try:
        ref = llm.supervisor.child("offload").ref
        with anyio.fail_after(timeout):
            return await ref.ask(GetOffloadStats())
    except Exception as exc:
        log.warning("metrics.offload_stats_failed", error=f"{type(exc).__name__}: {exc}")
        return None


def _walk(node: ActorInfo, prefix: str = "") -> Iterable[tuple[str, ActorInfo]]:
    """Every node of the tree with the name it has in the metrics: the actors of a data-parallel
    replica are named under it ("replica1/worker"), the others by their own name."""
    yield prefix + node.name, node
    inner = f"{prefix}{node.name}/" if node.kind == "supervisor" and _is_replica(node.name) else prefix
    for child in node.children:
        yield from _walk(child, inner)


def _is_replica(name: str) -> bool:
    return name.startswith("replica") and name[len("replica") :].isdigit()


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOAD = "sonar:server_load"
"""The `/load` gauge: kept in the shared directory, never shown on `/metrics`."""


def shared_metrics_dir() -> str | None:
    """The directory the API server processes share their series in (`--api-server-count` > 1;
    `sonar.cli.api_servers.share_metrics`), or None. prometheus_client picks its value class when
    it is imported, so the directory counts only when that class writes to it."""
    path = os.environ.get(MULTIPROC_ENV)
    return path if path and getattr(values.ValueClass, "_multiprocess", False) else None


class SharedCollector(Collector):
    """The per-request series of every API server process, from their files in the shared
    directory: counters and histograms summed over the processes (a dead one's files stay, so
    what it counted is not lost; a restarted one writes its own under its new pid)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Any]:
        files = glob.glob(os.path.join(self.path, "*.db"))
        for family in MultiProcessCollector.merge(files, accumulate=True):
            if family.name != LOAD:
                yield family

    def total(self, name: str) -> float:
        """Counter `name`'s value summed over the processes and its labels."""
        return sum(
            sample.value
            for family in self.collect()
            if family.name == name
            for sample in family.samples
            if sample.name == name + "_total"
        )

    def load(self) -> int:
        """The `LOAD` gauges of the live processes, summed (`mark_process_dead` removes a dead
        process's)."""
        files = glob.glob(os.path.join(self.path, "gauge_livesum_*.db"))
        families = MultiProcessCollector.merge(files, accumulate=False)
        return int(sum(s.value for f in families if f.name == LOAD for s in f.samples))


class ServerMetrics:
    """The app's metrics registry, its per-request instruments and its in-flight count."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        path = shared_metrics_dir()
        self.shared = None if path is None else SharedCollector(path)
        # Shared: the instruments write to this process's files and `self.shared` reads every
        # process's; registered here too, this process's values would show twice.
        r = self.registry if self.shared is None else None
        self.prompt_tokens = Counter("sonar:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("sonar:generation_tokens", "Generation tokens produced.", registry=r)
        self.request_success = Counter(
            "sonar:request_success", "Finished requests, by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "sonar:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "sonar:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sonar:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "sonar:request_queue_time_seconds",
            "Time from arrival to the first output (approximates the queue time).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        if self.shared is not None:
            self.registry.register(self.shared)
        self._in_flight = 0
        """HTTP requests to the generation routes whose response has not ended yet (`/load`)."""
        self._load = None
        if self.shared is not None:  # the other API servers read this process's count from its file
            self._load = Gauge(LOAD, "Generation requests in flight.", multiprocess_mode="livesum", registry=None)
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends, of this process
        # Totals for the stats log line (the Counters keep theirs, but reading them back is clumsy).
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    def add_load(self, delta: int) -> None:
        """A generation request started (1) or its response ended (-1)."""
        self._in_flight += delta
        if self._load is not None:
            self._load.inc(delta)

    @property
    def server_load(self) -> int:
        """Generation requests in flight: on this server, or shared, on every live API server."""
        return self._in_flight if self.shared is None else self.shared.load()

    def token_totals(self) -> tuple[float, float]:
        """Prompt and generation tokens counted so far, by this server or by every API server."""
        if self.shared is None:
            return self.total_prompt_tokens, self.total_generation_tokens
        return self.shared.total("sonar:prompt_tokens"), self.shared.total("sonar:generation_tokens")

    def request(self) -> "RequestRecorder":
        """A recorder for one HTTP request, arriving now."""
        return RequestRecorder(self)

    async def render(self, llm: LLM, timeout: float = 5.0) -> bytes:
        """The Prometheus text exposition, with the engine's stats asked for now."""
        try:
            with anyio.fail_after(timeout):
                if llm.replicas.count == 1:
                    self.engine.stats = [await llm.stats()]
                else:
                    self.engine.stats = await llm.replica_stats(timeout)
                self.engine.tracked = await llm.tracked_requests()
        except Exception as exc:  # the engine's metrics are left out of this scrape
            log.warning("metrics.stats_failed", error=f"{type(exc).__name__}: {exc}")
            self.engine.stats = self.engine.tracked = None
        self.engine.offloading = llm.config.offload_config() is not None
        self.engine.speculating = llm.config.speculative() is not None
        self.engine.vision = llm.info.vision is not None
        self.engine.max_loras = llm.config.max_loras if llm.config.enable_lora else 0
        self.engine.offload = await _offload_stats(llm, timeout) if llm.config.offload_manager_needed else None
        try:
            self.engine.tree = llm.tree()
        except Exception:
            self.engine.tree = None
        return generate_latest(self.registry)


class RequestRecorder:
    """Per-request observations of one HTTP request (all its prompts and choices).

    The handlers call `output()` for each engine output delta (the first one of a choice is its
    first token, later ones are the following tokens, the one with a finish reason is its end) and
    `close()` when they stop reading; `track()` does both around a delta stream.

    Queue time: the engine does not report when a request left the waiting queue, so
    `sonar:request_queue_time_seconds` is approximated as the time from the request's arrival at
    the server to its first output (it includes the prefill, as the time to first token does).
    """

    def __init__(self, metrics: ServerMetrics, trace: Trace | None = None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.trace = trace
        """--otlp-traces-endpoint: where each finished choice's span goes, once `describe` named
        the request (routes that never do, such as pooling, export no spans)."""
        self._described: tuple[Any, str] | None = None
        self._prompt_tokens: dict[int, int] = {}
        self._last: dict[tuple[int, int], float] = {}  # (prompt, choice) -> time of its last output
        self._finished: set[tuple[int, int]] = set()
        self._prompts_counted: set[int] = set()
        self._first: dict[tuple[int, int], float] = {}
        self._tokens: dict[tuple[int, int], int] = {}
        self._timing: dict[tuple[int, int], RequestTiming] = {}
        self._model_time: dict[tuple[int, int], RequestModelTime] = {}
        self._steps: dict[tuple[int, int], list[StepRef]] = {}
        """--collect-detailed-traces: the step spans each choice's span links to (sent a few at a
        time, bounded by the scheduler)."""

    def output(self, delta: StreamDelta, prompt: int = 0) -> None:
        """Record one output delta of choice `delta.index` of the request's `prompt`-th prompt."""
        m, now, key = self.metrics, time.monotonic(), (prompt, delta.index)
        if prompt not in self._prompts_counted and delta.num_prompt_tokens:
            self._prompts_counted.add(prompt)
            self._prompt_tokens[prompt] = delta.num_prompt_tokens
            m.prompt_tokens.inc(delta.num_prompt_tokens)
            m.total_prompt_tokens += delta.num_prompt_tokens
        if delta.timing is not None:
            self._timing[key] = delta.timing
        if delta.model_time is not None:
            self._model_time[key] = delta.model_time
            if delta.model_time.links:
                self._steps.setdefault(key, []).extend(delta.model_time.links)
        if delta.token_ids:
            m.generation_tokens.inc(len(delta.token_ids))
            m.total_generation_tokens += len(delta.token_ids)
            self._tokens[key] = self._tokens.get(key, 0) + len(delta.token_ids)
            last = self._last.get(key)
            if last is None:
                self._first[key] = now
                m.ttft.observe(now - self.arrival)
                m.queue.observe(now - self.arrival)
            else:
                m.itl.observe(now - last)
            self._last[key] = now
        if delta.finish_reason is not None and key not in self._finished:
            self._finished.add(key)
            m.request_success.labels(finished_reason=delta.finish_reason).inc()
            m.e2e.observe(now - self.arrival)
            self._span(key, now, delta.finish_reason)

    def describe(self, params: Any, model: str) -> None:
        """Name the request's sampling parameters and model, for its spans."""
        self._described = (params, model)

    def timing(self, prompt: int = 0, choice: int = 0) -> PerRequestMetrics:
        """--enable-per-request-metrics for one choice: the scheduler's queue time and time to
        first token, then this recorder's first-to-last token interval (None where unknown)."""
        key = (prompt, choice)
        first, last = self._first.get(key), self._last.get(key)
        return per_request_metrics(self._timing.get(key), first, last, self._tokens.get(key, 0))

    def close(self) -> None:
        """The handler stopped reading: a started choice that did not finish counts as aborted."""
        now = time.monotonic()
        for key in self._last.keys() - self._finished:
            self._finished.add(key)
            self.metrics.request_success.labels(finished_reason="abort").inc()
            self._span(key, now, "abort")

    def _span(self, key: tuple[int, int], now: float, finish_reason: str) -> None:
        if self.trace is None or self._described is None:
            return
        params, model = self._described
        times = SpanTimes(
            self.arrival,
            now,
            self._first.get(key),
            self._last.get(key),
            self._timing.get(key),
            self._model_time.get(key),
            self._steps.get(key, []),
        )
        prompt, choice = key
        attributes = span_attributes(
            self.trace.request_id,
            model,
            params,
            self._prompt_tokens.get(prompt, 0),
            self._tokens.get(key, 0),
            times,
            finish_reason,
        )
        attributes["sonar.prompt_index"] = prompt
        attributes["sonar.choice_index"] = choice
        self.trace.tracer.record(self.trace.parent, attributes, times)

    async def track(self, deltas: AsyncIterator[StreamDelta], prompt: int = 0) -> AsyncIterator[StreamDelta]:
        """Yield `deltas` (an `llm.stream(...)`), recording each one."""
        try:
            async for d in deltas:
                self.output(d, prompt)
                yield d
        finally:
            self.close()
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:  # leave the engine's stream now (it aborts what is unfinished)
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def generate(
        self, llm: LLM, prompt: str | list[int], params: Any, prompt_index: int = 0, **kwargs: Any
    ) -> RequestOutput:
        """`llm.generate(prompt, params, **kwargs)`, with each delta recorded as it arrives."""
        try:
            return await llm.generate(prompt, params, on_delta=lambda d: self.output(d, prompt_index), **kwargs)
        finally:
            self.close()


def per_request_metrics(
    timing: RequestTiming | None, first: float | None, last: float | None, tokens: int
) -> PerRequestMetrics:
    """vLLM's per-request figures from the scheduler's `timing` and the times (one clock) the
    first and the last of `tokens` generated tokens arrived."""
    metrics = PerRequestMetrics()
    if timing is not None:
        metrics.queue_time_ms = timing.queue_seconds * 1000
        metrics.time_to_first_token_ms = timing.first_token_seconds * 1000
    if first is None or last is None:
        return metrics
    decode = last - first
    metrics.generation_time_ms = decode * 1000
    if tokens > 1:
        metrics.mean_itl_ms = decode / (tokens - 1) * 1000
    if timing is not None and timing.first_token_seconds + decode > 0:
        metrics.tokens_per_second = tokens / (timing.first_token_seconds + decode)
    return metrics


class LoadMiddleware:
    """Counts the HTTP requests to the generation routes in flight (until their response, streamed
    or whole, has ended) in `metrics.server_load`: what `GET /load` reports."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _path(scope) not in LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.metrics.add_load(1)
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.add_load(-1)


def _path(scope: Scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


# -- the periodic stats log line -------------------------------------------------------------------
def stats_line(
    stats: Any,
    prompt_tps: float,
    generation_tps: float,
    hit_rate: float | None,
    acceptance_length: float | None = None,
) -> dict[str, Any]:
    """The fields of one stats log line (vLLM's "Avg prompt throughput ..." line); with speculative
    decoding, the mean acceptance length over the interval (tokens per step of a request that
    carried drafts: 1 + accepted drafts; n/a when none did)."""
    fields = {
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "kv_cache_usage": f"{stats.kv_usage * 100:.1f}%",
        "prompt_tokens_per_s": round(prompt_tps, 1),
        "generation_tokens_per_s": round(generation_tps, 1),
        "prefix_cache_hit_rate": "n/a" if hit_rate is None else f"{hit_rate * 100:.1f}%",
    }
    if acceptance_length is not None:
        fields["mean_acceptance_length"] = "n/a" if acceptance_length < 1 else round(acceptance_length, 2)
    return fields


async def log_stats_forever(llm: LLM, metrics: ServerMetrics, interval: float = 10.0) -> None:
    """Every `interval` seconds log running/waiting requests, KV cache usage, prompt and generation
    throughput over the interval, and the prefix cache hit rate over the interval (of the prompt
    tokens looked up in it; n/a when none were)."""
    last_time = time.monotonic()
    last_prompt, last_gen = metrics.token_totals()
    last_queries = last_hits = None
    last_drafts = last_accepted = 0
    speculating = llm.config.speculative() is not None
    while True:
        await anyio.sleep(interval)
        try:
            with anyio.fail_after(interval):
                stats = await llm.stats()
        except Exception as exc:
            log.warning("stats.unavailable", error=f"{type(exc).__name__}: {exc}")
            continue
        now = time.monotonic()
        elapsed = max(now - last_time, 1e-9)
        prompt, gen = metrics.token_totals()
        queries = stats.prefix_queries - (last_queries or 0)
        hits = stats.prefix_hits - (last_hits or 0)
        acceptance = None
        if speculating:
            drafts = stats.spec_num_drafts - last_drafts
            acceptance = 1 + (stats.spec_num_accepted_tokens - last_accepted) / drafts if drafts else 0.0
            last_drafts, last_accepted = stats.spec_num_drafts, stats.spec_num_accepted_tokens
        fields = stats_line(
            stats,
            (prompt - last_prompt) / elapsed,
            (gen - last_gen) / elapsed,
            hits / queries if queries > 0 else None,
            acceptance,
        )
        log.info("engine.stats", **fields)
        last_time, last_prompt, last_gen = now, prompt, gen
        last_queries, last_hits = stats.prefix_queries, stats.prefix_hits


@asynccontextmanager
async def stats_logging(llm: LLM, metrics: ServerMetrics, interval: float | None) -> AsyncIterator[None]:
    """Run `log_stats_forever` for the length of the block (not at all when `interval` is None)."""
    if interval is None:
        yield
        return
    async with anyio.create_task_group() as tg:
        tg.start_soon(log_stats_forever, llm, metrics, interval)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


@dataclass
class Trace:
    """Where one HTTP request's spans go: the app's tracer, the client's trace context
    (``traceparent``) and the request's id."""

    tracer: RequestTracer
    parent: Any
    request_id: str


def recorder(request: Any) -> RequestRecorder:
    """A recorder for `request`, arriving now, on its app's `ServerMetrics` (`app.state.metrics`);
    with the app's tracer (`app.state.tracer`, --otlp-traces-endpoint) it exports the request's spans."""
    tracer: RequestTracer | None = getattr(request.app.state, "tracer", None)
    if tracer is None:
        return request.app.state.metrics.request()
    rid = getattr(request.state, "request_id", "")
    return RequestRecorder(request.app.state.metrics, Trace(tracer, tracer.parent(request.headers), rid))
