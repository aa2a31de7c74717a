"""The physical floor of one decode step, and how close a measured TPOT comes to it.

One decode step reads every weight once (bandwidth-bound: weight bytes / memory read bandwidth)
and does 2 FLOPs per parameter per sequence in the batch (compute-bound: 2 · params · batch / FLOP
rate); the step cannot be faster than the larger of the two. Attention, norms and everything
else come on top, so a real engine sits above this floor: the ratio says how far.

The read bandwidth is the server machine's: `bench serve` measures it on its own machine after the
run (`sonar.bench.bandwidth`) when the server is there too (a loopback address), and needs
``--peak-bandwidth-gbs`` for a server elsewhere (one bound to another address of this machine
counts as elsewhere: say its bandwidth). A constant from another machine would put
the floor wherever that machine's memory is: on a VM whose bandwidth moves by a third within
minutes, the same TPOT reads as a different distance from the floor each hour.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Matmul throughput per dtype, measured on a 2-core AVX512-BF16 EPYC (BENCHMARKS.md).
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
        default=None,
        help="the server machine's memory read bandwidth in GB/s (default: measured here after the "
        "run when the server is on this machine, a loopback address; needed for a server elsewhere)",
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
    #: whether `bandwidth_gbs` was measured on the server's machine in this run (else given)
    bandwidth_measured: bool
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
    bandwidth_gbs: float,
    bandwidth_measured: bool = False,
    weight_bytes: float | None = None,
    gflops: float | None = None,
) -> Floor:
    """The floor of one decode step of `batch` sequences (at least 1) for a model of `params`, at
    `bandwidth_gbs` GB/s of memory reads."""
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
        bandwidth_measured,
        gflops,
        bw_ms,
        fl_ms,
        floor,
        "bandwidth" if bw_ms >= fl_ms else "compute",
        tpot_ms,
        ratio,
    )


def floor_from_args(
    args: Any, config_params: int | None, batch: float, tpot_ms: float | None, measured_gbs: float | None = None
) -> Floor | None:
    """The floor for parsed flags (see `add_floor_arguments`) at ``--peak-bandwidth-gbs``, else at
    `measured_gbs` (measured on the server's machine); None when the model's size or the bandwidth
    is unknown (`missing_floor` says which)."""
    params = args.model_params or config_params
    bandwidth = args.peak_bandwidth_gbs or measured_gbs
    if not params or not bandwidth:
        return None
    gflops = args.peak_gflops_fp32 if args.floor_dtype == "float32" else args.peak_gflops_bf16
    return step_floor(
        float(params),
        args.floor_dtype,
        batch,
        tpot_ms,
        bandwidth_gbs=bandwidth,
        bandwidth_measured=not args.peak_bandwidth_gbs,
        weight_bytes=args.model_bytes,
        gflops=gflops,
    )


def missing_floor(params: float | None) -> str:
    """Why `floor_from_args` had no floor for a model of `params` (None: unknown), as a report line."""
    if not params:
        return "unknown model size: pass --model-params"
    return "the server is not on this machine, so its memory bandwidth was not measured: pass --peak-bandwidth-gbs"


def format_floor(f: Floor) -> list[str]:
    """Report lines for `f`."""
    lines = [
        f"model: {f.params / 1e6:.1f} M params, {f.weight_bytes / 1e6:.0f} MB of {f.dtype} weights; "
        f"mean batch {f.batch:.1f}",
        f"floor per step: bandwidth {f.bandwidth_floor_ms:.2f} ms ({f.bandwidth_gbs:.1f} GB/s of reads, "
        f"{'measured here' if f.bandwidth_measured else 'given'}), "
        f"compute {f.compute_floor_ms:.2f} ms ({f.gflops:g} GFLOP/s) -> {f.floor_ms:.2f} ms ({f.bound}-bound)",
    ]
    if f.tpot_over_floor is not None:
        lines.append(
            f"measured mean TPOT {f.measured_tpot_ms:.2f} ms = {f.tpot_over_floor:.2f}x the floor "
            f"({100.0 / f.tpot_over_floor:.1f}% of floor speed)"
        )
    return lines
