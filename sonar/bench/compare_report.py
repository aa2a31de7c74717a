"""What `bench compare` concludes from its runs: per cell and server the spread over rounds, the
subject's ratios against the best peer, and whether each goal is met (no I/O here).

The goals are issue 20's: at concurrency 4 and above the subject's output throughput is at
least 1.3x the best peer's and its mean TTFT at most 0.8x the best peer's; at concurrency 1 its
decode TPOT (the median, a step's steady cost) is within 1.1x of the weight-read floor and its TTFT at most 0.8x the best peer's.

A result may be partial (written after every run while the grid is measured, or when it was
stopped early): a cell without runs yet, or without some server's, is reported and judged on
what it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Any, Sequence

#: The figures of one `bench serve` run that a comparison keeps.
RUN_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
)


@dataclass(frozen=True)
class Goals:
    throughput_ratio: float = 1.3
    ttft_ratio: float = 0.8
    floor_ratio: float = 1.1
    #: The lowest concurrency the throughput and TTFT goals apply to.
    load_concurrency: int = 4


@dataclass(frozen=True)
class Spread:
    """One metric over the rounds of a cell."""

    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        values = [v for v in values if v is not None]
        return cls(fmean(values), min(values), max(values)) if values else None

    def text(self, digits: int) -> str:
        low, high = f"{self.low:.{digits}f}", f"{self.high:.{digits}f}"
        return low if low == high else f"{low}–{high}"


@dataclass(frozen=True)
class Check:
    """One goal on one cell: the measured ratio against its bound."""

    name: str
    ratio: float
    bound: float
    #: True: the ratio must be at least the bound; False: at most.
    at_least: bool

    @property
    def met(self) -> bool:
        return self.ratio >= self.bound if self.at_least else self.ratio <= self.bound

    def text(self) -> str:
        sign = "≥" if self.at_least else "≤"
        return f"{self.name} {self.ratio:.2f}× ({sign}{self.bound:g} {'✓' if self.met else '✗'})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ratio": self.ratio, "bound": self.bound, "at_least": self.at_least, "met": self.met}


def spreads(runs: Sequence[dict[str, Any]]) -> dict[str, Spread | None]:
    """Output throughput, mean TTFT and mean TPOT of a server's runs of one cell."""
    return {
        key: Spread.of([r.get(key) for r in runs])
        for key in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    }


def cell_checks(
    concurrency: int,
    runs: dict[str, Sequence[dict[str, Any]]],
    subject: str,
    floor_ms: float | None,
    goals: Goals = Goals(),
) -> list[Check]:
    """The goals that apply to a cell, judged on the mean over rounds; none where the subject did
    not finish every request (a failed run is reported as such, not judged)."""
    mine = runs.get(subject) or []
    if not mine or any(r.get("failed") for r in mine):
        return []
    me = spreads(mine)
    peers = [spreads(r) for name, r in runs.items() if name != subject and r and not any(x.get("failed") for x in r)]
    best_tput = max((p["output_throughput"].mean for p in peers if p["output_throughput"]), default=None)
    best_ttft = min((p["mean_ttft_ms"].mean for p in peers if p["mean_ttft_ms"]), default=None)
    checks: list[Check] = []
    if concurrency >= goals.load_concurrency and best_tput and me["output_throughput"]:
        checks.append(Check("tok/s", me["output_throughput"].mean / best_tput, goals.throughput_ratio, True))
    if concurrency == 1 and floor_ms and me["median_tpot_ms"]:
        checks.append(Check("TPOT/floor", me["median_tpot_ms"].mean / floor_ms, goals.floor_ratio, False))
    if (concurrency == 1 or concurrency >= goals.load_concurrency) and best_ttft and me["mean_ttft_ms"]:
        checks.append(Check("TTFT", me["mean_ttft_ms"].mean / best_ttft, goals.ttft_ratio, False))
    return checks


def judge(cells: Sequence[dict[str, Any]], subject: str, floor_ms: float | None) -> None:
    """Set each cell's ``checks`` from the runs it has so far."""
    for cell in cells:
        checks = cell_checks(cell["concurrency"], cell.get("runs", {}), subject, floor_ms)
        cell["checks"] = [c.to_dict() for c in checks]


def runs_done(cells: Sequence[dict[str, Any]]) -> int:
    """How many runs the cells hold, over every server and round."""
    return sum(len(runs) for cell in cells for runs in cell.get("runs", {}).values())


def _cell_label(cell: dict[str, Any]) -> str:
    if cell["workload"] == "shared-prefix":
        return f"{cell['prefix_len']}+{cell['input_len'] - cell['prefix_len']}"
    return str(cell["input_len"])


def grid_table(cells: Sequence[dict[str, Any]], servers: Sequence[str], subject: str) -> str:
    """A markdown table: a row per cell, each server's output tok/s, mean TTFT and mean TPOT
    (low–high over rounds), then the subject's goals."""
    head = ["conc.", "input"]
    for metric in ("out tok/s", "mean TTFT ms", "mean TPOT ms"):
        head += [f"{name} {metric}" for name in servers]
    head.append(f"{subject} against the best peer")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        row = [str(cell["concurrency"]), _cell_label(cell)]
        runs = cell.get("runs", {})
        per = {name: spreads(runs.get(name) or []) for name in servers}
        for key, digits in (("output_throughput", 1), ("mean_ttft_ms", 0), ("mean_tpot_ms", 1)):
            for name in servers:
                failed = sum(r.get("failed") or 0 for r in runs.get(name) or [])
                value = per[name][key].text(digits) if per[name][key] else "n/a"
                row.append(f"{value} ({failed} failed)" if failed else value)
        row.append("; ".join(Check(**_check_args(c)).text() for c in cell.get("checks", [])) or "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _check_args(c: dict[str, Any]) -> dict[str, Any]:
    return {k: c[k] for k in ("name", "ratio", "bound", "at_least")}


def format_markdown(result: dict[str, Any]) -> str:
    """The whole comparison as markdown: the machine and floor, each server's ready time and peak
    memory, one table per workload and how many goals were met; first, while runs are missing, how
    many of those planned are in."""
    subject = result["subject"]
    names = [s["name"] for s in result["servers"]]
    floor = result.get("floor") or {}
    out = [f"# bench compare, {result['date']}", ""]
    progress = _progress_line(result)
    if progress:
        out += [progress, ""]
    if floor:
        out.append(
            f"Weight-read floor of a decode step: {floor['weight_bytes'] / 1e6:.0f} MB of weights / "
            f"{floor['bandwidth_gbs']:.1f} GB/s measured read bandwidth = {floor['floor_ms']:.2f} ms."
        )
        out.append("")
    out += ["| server | ready s | peak memory MiB (Pss, whole process tree) |", "|---|---|---|"]
    for s in result["servers"]:
        mem = f"{s['peak_pss_bytes'] / (1 << 20):.0f}" if s.get("peak_pss_bytes") else "n/a"
        out.append(f"| {s['name']} | {s['ready_s']:.1f} | {mem} |")
    for workload in dict.fromkeys(c["workload"] for c in result["cells"]):
        cells = [c for c in result["cells"] if c["workload"] == workload]
        out += ["", f"## {workload} (output {cells[0]['output_len']} tokens)", "", grid_table(cells, names, subject)]
    checks = [c for cell in result["cells"] for c in cell.get("checks", [])]
    met = sum(1 for c in checks if c["met"])
    out += ["", f"Goals met: {met} of {len(checks)}."]
    return "\n".join(out) + "\n"


def _progress_line(result: dict[str, Any]) -> str | None:
    """``partial: 7 of 24 runs`` (and what stopped it) while runs are missing; None once all are in
    (or for a result that does not say how many were planned)."""
    planned = result.get("runs_planned")
    done = runs_done(result["cells"])
    if planned is None or done >= planned:
        return None
    stopped = f", stopped by {result['stopped_by']}" if result.get("stopped_by") else ""
    return f"partial: {done} of {planned} runs{stopped}"
