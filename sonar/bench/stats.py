"""From per-request timings to the figures of a serving benchmark.

TTFT: time to the first token. TPOT: time per output token after the first,
``(latency - ttft) / (output_tokens - 1)`` per request. ITL: every gap between two token
arrivals. E2EL: the request's whole latency. Goodput: requests per second that met every SLO
given with ``--goodput`` (``ttft``, ``tpot``, ``e2el`` in milliseconds).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

from sonar.bench.endpoint import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, not {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: must not be negative")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``."""
    out = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in out):
        raise ValueError(f"--metric-percentiles must lie in (0, 100], got {text!r}")
    return out


def parse_metric_names(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(bad)} (choose from {', '.join(METRICS)})")
    return names


def _tpot(r: RequestResult) -> float | None:
    if not r.streamed:  # answered whole: its latency over its tokens
        return r.latency / r.output_tokens if r.output_tokens else None
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _describe(values_s: Iterable[float], percentiles: Sequence[float]) -> dict[str, Any]:
    ms = np.asarray(list(values_s), dtype=np.float64) * 1e3
    if ms.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, "percentiles": {_pct_key(p): 0.0 for p in percentiles}}
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
        "percentiles": {_pct_key(p): float(np.percentile(ms, p)) for p in percentiles},
    }


def _pct_key(p: float) -> str:
    return f"p{p:g}"


def tokens_per_second_series(results: Sequence[RequestResult], t0: float, bin_s: float = 1.0) -> list[float]:
    """Output tokens that arrived in each `bin_s`-second bin since `t0`."""
    times = [t - t0 for r in results if r.success for t in r.token_times]
    if not times:
        return []
    bins = [0.0] * (int(max(times) // bin_s) + 1)
    for t in times:
        bins[int(max(t, 0.0) // bin_s)] += 1.0 / bin_s
    return bins


def concurrency_peak(results: Sequence[RequestResult]) -> int:
    """The most requests that were in flight at one moment."""
    # An end sorts before a start at the same instant: back-to-back requests do not overlap.
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float],
    slos: dict[str, float] | None = None,
    t0: float | None = None,
) -> dict[str, Any]:
    """The benchmark's figures (request and token throughput, latency statistics in ms, goodput)."""
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (_tpot(r) for r in ok) if t is not None]
    good = 0
    for r in ok:
        tpot = _tpot(r) or 0.0
        checks = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
        if all(checks[name] * 1e3 <= limit for name, limit in (slos or {}).items()):
            good += 1
    series = tokens_per_second_series(results, t0 if t0 is not None else min((r.start for r in results), default=0))
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput_slos_ms": dict(slos or {}),
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "peak_output_throughput": max(series, default=0.0),
        "peak_concurrent_requests": concurrency_peak(results),
        # Mean requests in flight (Little's law): the mean decode batch the server saw.
        "mean_concurrency": sum(r.latency for r in ok) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        d = _describe(values, percentiles)
        out[f"mean_{name}_ms"] = d["mean"]
        out[f"median_{name}_ms"] = d["median"]
        out[f"std_{name}_ms"] = d["std"]
        for key, value in d["percentiles"].items():
            out[f"{key}_{name}_ms"] = value
    return out


def finite(x: Any) -> Any:
    """JSON-safe numbers: NaN and infinities become None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
