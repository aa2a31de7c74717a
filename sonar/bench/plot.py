"""PNG plots of benchmark runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sonar.bench.endpoint import RequestResult
from sonar.bench.stats import tokens_per_second_series


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path, title: str) -> Path:
    """Title the figure, write it as a PNG (making its folder) and close it."""
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_serve(results: Sequence[RequestResult], t0: float, path: str | Path, title: str = "") -> Path:
    """Latency distributions (TTFT, TPOT, ITL, E2EL) and output tokens/s over time, in one PNG."""
    plt = _pyplot()
    ok = [r for r in results if r.success]
    series = {
        "TTFT (ms)": [r.ttft * 1e3 for r in ok],
        "TPOT (ms)": [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1],
        "ITL (ms)": [x * 1e3 for r in ok for x in r.itl],
        "E2E latency (ms)": [r.latency * 1e3 for r in ok],
    }
    fig = plt.figure(figsize=(12, 8), constrained_layout=True)
    grid = fig.add_gridspec(3, 2)
    for i, (label, values) in enumerate(series.items()):
        ax = fig.add_subplot(grid[i // 2, i % 2])
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                v = float(np.percentile(values, q))
                ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:.1f}")
            ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    ax = fig.add_subplot(grid[2, :])
    end = max((t for r in ok for t in r.token_times), default=t0)
    bin_s = max(1.0, (end - t0) / 120)  # about 120 bins however long the run
    tps = tokens_per_second_series(results, t0, bin_s)
    ax.plot([i * bin_s for i in range(len(tps))], tps, drawstyle="steps-post", color="tab:green")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel(f"output tokens/s ({bin_s:.3g} s bins)")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path, title)


def plot_sweep(points: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Output throughput against mean TPOT and mean TTFT, one labelled point per sweep point."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for ax, key, label in ((axes[0], "mean_tpot_ms", "mean TPOT (ms)"), (axes[1], "mean_ttft_ms", "mean TTFT (ms)")):
        xs = [p["result"].get(key, 0.0) for p in points]
        ys = [p["result"].get("output_throughput", 0.0) for p in points]
        ax.plot(xs, ys, "o", color="tab:blue")
        for p, x, y in zip(points, xs, ys):
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, title)


def plot_compare(cells: Sequence[dict[str, Any]], servers: Sequence[str], path: str | Path, title: str = "") -> Path:
    """One workload of `bench compare`: a column per input length, output tokens/s (top) and mean
    TTFT (bottom) against concurrency, a line per server (mean over rounds)."""
    plt = _pyplot()
    lengths = list(dict.fromkeys(c["input_len"] for c in cells))
    fig, axes = plt.subplots(2, len(lengths), figsize=(5 * len(lengths), 8), squeeze=False, constrained_layout=True)
    for col, length in enumerate(lengths):
        row_cells = sorted((c for c in cells if c["input_len"] == length), key=lambda c: c["concurrency"])
        for row, (key, label) in enumerate(
            (("output_throughput", "output tokens/s"), ("mean_ttft_ms", "mean TTFT (ms)"))
        ):
            ax = axes[row][col]
            for name in servers:
                points = [
                    (c["concurrency"], float(np.mean(values)))
                    for c in row_cells
                    if (values := [r[key] for r in c.get("runs", {}).get(name, []) if r.get(key) is not None])
                ]
                if points:
                    ax.plot(*zip(*points), "o-", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(f"input {length} tokens")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    return _save(plt, fig, path, title or cells[0]["workload"])
