"""The physical floor of one decode step, and how close a measured TPOT comes to it.

One decode step reads every weight once (bandwidth-bound: weight bytes / memory bandwidth) and
does 2 FLOPs per parameter per sequence in the batch (compute-bound: 2 · params · batch / FLOP
rate); the step cannot be faster than the larger of the two. Attention, norms and everything
else come on top, so a real engine sits above this floor: the ratio says how far.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: This machine's measured ceilings (see BENCHMARKS.md): copy bandwidth counting read + write,
#: and matmul throughput per dtype.
DEFAULT_BANDWIDTH_GBS = 50.0
DEFAULT_GFLOPS = {"bfloat16": 390.0, "float16": 390.0, "float32": 157.0}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_floor_arguments(parser: Any) -> None:
    """The flags that describe the model and the machine for the floor."""
    g = parser.add_argument_group("physical floor")
    g.add_argument(
        "--model-params",
        type=float,
        default=None,
        help="parameter count of the served model (default: computed from its local config.json)",
    )
    g.add_argument(
        "--model-bytes",
        type=float,
        default=None,
        help="bytes of weights read per step (default: params × the size of --floor-dtype)",
    )
    g.add_argument(
        "--floor-dtype",
        choices=sorted(DTYPE_BYTES),
        default="bfloat16",
        help="the dtype the server computes in (picks the FLOP rate and weight bytes)",
    )
    g.add_argument(
        "--peak-bandwidth-gbs",
        type=float,
        default=DEFAULT_BANDWIDTH_GBS,
        help="memory bandwidth in GB/s (this machine copies ~50 GB/s read+write)",
    )
    g.add_argument(
        "--peak-gflops-bf16", type=float, default=DEFAULT_GFLOPS["bfloat16"], help="bf16/fp16 matmul rate in GFLOP/s"
    )
    g.add_argument(
        "--peak-gflops-fp32", type=float, default=DEFAULT_GFLOPS["float32"], help="fp32 matmul rate in GFLOP/s"
    )


@dataclass
class Floor:
    """The per-step floor at `batch` sequences and the measured TPOT beside it."""

    params: float
    weight_bytes: float
    dtype: str
    batch: float
    bandwidth_gbs: float
    gflops: float
    bandwidth_floor_ms: float
    compute_floor_ms: float
    floor_ms: float
    bound: str
    measured_tpot_ms: float | None
    #: measured TPOT / floor: 1.0 would be the floor itself.
    tpot_over_floor: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_floor(
    params: float,
    dtype: str,
    batch: float,
    tpot_ms: float | None,
    *,
    weight_bytes: float | None = None,
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS,
    gflops: float | None = None,
) -> Floor:
    """The floor of one decode step of `batch` sequences (at least 1) for a model of `params`."""
    batch = max(1.0, batch)
    weight_bytes = weight_bytes if weight_bytes is not None else params * DTYPE_BYTES[dtype]
    gflops = gflops if gflops is not None else DEFAULT_GFLOPS[dtype]
    bw_ms = weight_bytes / (bandwidth_gbs * 1e9) * 1e3
    fl_ms = 2.0 * params * batch / (gflops * 1e9) * 1e3
    floor = max(bw_ms, fl_ms)
    ratio = tpot_ms / floor if tpot_ms and floor > 0 else None
    return Floor(
        params,
        weight_bytes,
        dtype,
        batch,
        bandwidth_gbs,
        gflops,
        bw_ms,
        fl_ms,
        floor,
        "bandwidth" if bw_ms >= fl_ms else "compute",
        tpot_ms,
        ratio,
    )


def floor_from_args(args: Any, config_params: int | None, batch: float, tpot_ms: float | None) -> Floor | None:
    """The floor for parsed flags (see `add_floor_arguments`), or None when the size is unknown."""
    params = args.model_params or config_params
    if not params:
        return None
    gflops = args.peak_gflops_fp32 if args.floor_dtype == "float32" else args.peak_gflops_bf16
    return step_floor(
        float(params),
        args.floor_dtype,
        batch,
        tpot_ms,
        weight_bytes=args.model_bytes,
        bandwidth_gbs=args.peak_bandwidth_gbs,
        gflops=gflops,
    )


def format_floor(f: Floor) -> list[str]:
    """Report lines for `f`."""
    lines = [
        f"model: {f.params / 1e6:.1f} M params, {f.weight_bytes / 1e6:.0f} MB of {f.dtype} weights; "
        f"mean batch {f.batch:.1f}",
        f"floor per step: bandwidth {f.bandwidth_floor_ms:.2f} ms ({f.bandwidth_gbs:g} GB/s), "
        f"compute {f.compute_floor_ms:.2f} ms ({f.gflops:g} GFLOP/s) -> {f.floor_ms:.2f} ms ({f.bound}-bound)",
    ]
    if f.tpot_over_floor is not None:
        lines.append(
            f"measured mean TPOT {f.measured_tpot_ms:.2f} ms = {f.tpot_over_floor:.2f}x the floor "
            f"({100.0 / f.tpot_over_floor:.1f}% of floor speed)"
        )
    return lines
