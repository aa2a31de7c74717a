"""Model FLOPs and bytes of one step (``--enable-mfu-metrics``), estimated from the model's shape
and the step's tokens, as the usual analytic count (the one MFU is defined by):

- **linear layers**: 2 FLOPs per weight per token: ``2 * P * T`` for the ``P`` projection weights
  of all decoder layers and the ``T`` tokens the step computes, plus ``2 * hidden * vocab`` for
  each row it samples (the LM head runs on sampled positions only);
- **attention**: a token at position ``p`` scores and mixes ``p + 1`` keys and values in each
  layer, ``4 * q_dim`` FLOPs each (``q_dim`` = query heads x head size), so a request computing
  ``n`` tokens after ``c`` known ones costs ``4 * q_dim * layers * (n * c + n * (n + 1) / 2)``;
- **bytes read**: every weight once per step (the projections and the LM head) and each request's
  KV cache up to its last position once per layer (``2 * kv_dim`` values per position), all in
  the model's dtype.

Left out, as small next to those: norms, activations, rotary embeddings, embedding lookups,
sampling. Mixture-of-experts MLPs are counted as the config's dense MLP shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

__all__ = ["MFUStats", "ModelShape", "StepCost", "step_cost"]


class ModelShape(msgspec.Struct, frozen=True):
    """What the estimate needs of the model (whole, not a tensor-parallel rank's share)."""

    num_layers: int
    projection_weights: int
    """Weights of one decoder layer's projections (q, k, v, o, gate, up, down)."""
    q_dim: int
    kv_dim: int
    hidden: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def of(
        cls, projections: Mapping[str, tuple[int, int]], num_layers: int, vocab: int, dtype_bytes: int
    ) -> "ModelShape":
        """From a worker's ``(in_features, out_features)`` projections by name."""
        return cls(
            num_layers=num_layers,
            projection_weights=sum(i * o for i, o in projections.values()),
            q_dim=projections["q_proj"][1],
            kv_dim=projections["k_proj"][1],
            hidden=projections["o_proj"][1],
            vocab=vocab,
            dtype_bytes=dtype_bytes,
        )


class StepCost(msgspec.Struct, frozen=True):
    flops: int
    read_bytes: int


def step_cost(shape: ModelShape, chunks: Iterable[tuple[int, int, int]]) -> StepCost:
    """The cost of a step computing, per request, ``(start, tokens, sampled)``: ``tokens`` new
    positions after ``start`` known ones, of which ``sampled`` rows go through the LM head. A
    step without tokens (one that only moves KV to or from the offload tiers) costs nothing."""
    tokens = sampled = pairs = context = 0
    for start, n, rows in chunks:
        tokens += n
        sampled += rows
        pairs += n * start + n * (n + 1) // 2
        context += start + n
    if tokens == 0:
        return StepCost(0, 0)
    layers = shape.num_layers
    weights = shape.projection_weights * layers + shape.hidden * shape.vocab
    flops = (
        2 * shape.projection_weights * layers * tokens
        + 2 * shape.hidden * shape.vocab * sampled
        + 4 * shape.q_dim * layers * pairs
    )
    read = shape.dtype_bytes * (weights + 2 * shape.kv_dim * layers * context)
    return StepCost(flops, read)


class MFUStats(msgspec.Struct, gc=False):
    """Since start (`SchedulerStats.mfu`): the estimated FLOPs and bytes read of the steps run (per
    device: the model's, split evenly over its ranks), the seconds the worker spent on them, and
    the device's peak FLOP/s (0 when Sonar does not know it)."""

    flops: int = 0
    read_bytes: int = 0
    busy_seconds: float = 0.0
    peak_flops: float = 0.0

    @staticmethod
    def summed(parts: list[MFUStats]) -> MFUStats:
        """Several replicas' counts as one engine's; the peak stays per device (the replicas run on
        devices of one kind)."""
        return MFUStats(
            sum(p.flops for p in parts),
            sum(p.read_bytes for p in parts),
            sum(p.busy_seconds for p in parts),
            max(p.peak_flops for p in parts),
        )
