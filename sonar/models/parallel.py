"""Tensor and pipeline parallelism: how a decoder's weights split over ranks, and its collectives.

Megatron's layout, with torch.distributed for every collective (gloo on the CPU, NCCL on GPUs):

* q/k/v and gate/up are *column*-parallel: each rank holds the output rows of its attention heads
  and its slice of the intermediate size, and computes them without talking to the others;
* o_proj and down_proj are *row*-parallel: each rank multiplies its slice of the input columns,
  and one all-reduce sums the partial outputs (their biases live on rank 0 alone, so the sum
  adds them once);
* the embedding and the LM head are *vocab*-parallel: each rank holds ``ceil(vocab / size)`` rows
  (the last one zero-padded); an embedding lookup zeroes the ids outside the rank's rows and
  all-reduces, the LM head's logits are all-gathered along the vocabulary.

Pipeline parallelism partitions the layers into consecutive stages (`partition_layers`); a stage
holds only its layers' weights and KV cache (every stage keeps the embedding and the LM head, the
first and the last use them), and passes the hidden states and the residual stream on to the next
stage point to point.

KV heads split like query heads; with fewer KV heads than ranks each KV head is replicated on
``size / num_kv_heads`` consecutive ranks (the ones whose query heads read it), so the KV cache of
a rank always holds whole heads. Norms, rotary tables and per-head q/k norms are replicated.

Expert parallelism (`TensorParallel.expert_placement`) deals a MoE layer's experts, whole, over the
same ranks instead of slicing each (`sonar.models.moe`); attention stays tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError


class ParallelLayoutError(ModelLoadError):
    """The model's shapes do not split over the requested number of ranks."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; ``size`` 1 (`SINGLE`) is no parallelism.

    `group` is the torch.distributed process group (None: the default one)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_placement: str | None = None
    """Expert parallelism (``--enable-expert-parallel``): how a MoE layer's whole experts are dealt
    over the group's ranks, ``linear`` or ``round_robin`` (`local_experts`); None: each expert is
    sliced over the ranks like a dense MLP."""
    redundant_experts: int | None = None
    """Expert load balancing (``--enable-eplb``, `sonar.models.eplb`): each MoE layer has this many
    expert slots beyond its experts, for replicas, and a placement that changes with the load;
    None: the fixed placement of `local_experts`."""

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that samples and answers the scheduler."""
        return self.rank == 0

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, intermediate rows) that must split evenly."""
        if total % self.size:
            raise ParallelLayoutError(
                f"--tensor-parallel-size {self.size} does not divide the model's {what} ({total})"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads this rank holds, index of its first) — replicated when there are fewer than ranks."""
        if num_kv_heads >= self.size:
            local = self.split(num_kv_heads, "number of KV heads")
            return local, self.rank * local
        if self.size % num_kv_heads:
            raise ParallelLayoutError(
                f"--tensor-parallel-size {self.size} is neither a divisor nor a multiple of the model's "
                f"number of KV heads ({num_kv_heads})"
            )
        return 1, self.rank // (self.size // num_kv_heads)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """(rows of the vocabulary each rank holds, this rank's first row)."""
        per_rank = -(-vocab_size // self.size)
        return per_rank, self.rank * per_rank

    def local_experts(self, num_experts: int) -> list[int]:
        """The global ids of the experts this rank holds, ascending: all of them without expert
        parallelism; ``linear``, the rank's contiguous range of ``E / size``; ``round_robin``, the
        experts ``e`` with ``e % size == rank``."""
        if self.expert_placement is None:
            return list(range(num_experts))
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise ParallelLayoutError(
                f"--expert-placement-strategy {self.expert_placement!r} is not one of {', '.join(EXPERT_PLACEMENTS)}"
            )
        if num_experts % self.size:
            raise ParallelLayoutError(
                f"--enable-expert-parallel over {self.size} ranks needs the model's number of experts "
                f"({num_experts}) to be a multiple of {self.size}"
            )
        per_rank = num_experts // self.size
        if self.expert_placement == "linear":
            return list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        return list(range(self.rank, num_experts, self.size))

    def local_expert_ids(self, ids: Tensor, num_experts: int) -> Tensor:
        """The router's global expert `ids` as indices into this rank's `local_experts`, -1 for
        the experts other ranks hold (arithmetic on `ids`: no table to keep on the device)."""
        if self.expert_placement is None or self.size == 1:
            return ids
        if self.expert_placement == "linear":
            per_rank = num_experts // self.size
            local = ids - self.rank * per_rank
            return torch.where((local >= 0) & (local < per_rank), local, -1)
        return torch.where(ids % self.size == self.rank, ids // self.size, -1)

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of `x` over the group, in place (`x` itself with one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: Tensor) -> Tensor:
        """The ranks' `x` side by side along the last dimension, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()

EXPERT_PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class Shard:
    """A rank's part of a checkpoint tensor: ``size`` slices along ``dim`` from ``first`` (zero past
    the tensor's end), or with ``leader_only`` the whole tensor on rank 0 and zeros elsewhere (a
    row-parallel layer's bias, added once after the all-reduce)."""

    dim: int = 0
    first: int = 0
    size: int = 0
    leader_only: bool = False
    leader: bool = True

    def tensor(self, t: Tensor) -> Tensor:
        if self.leader_only:
            return t if self.leader else torch.zeros_like(t)
        return shard_rows(t, self.first, self.size, self.dim)

    def quantized(self, qw: QuantizedWeight, name: str) -> QuantizedWeight:
        """The same part of a quantized weight (``[N, K]`` values, ``[N, K / group]`` scales): rows as
        they come; input columns in whole groups, and only without an act-order permutation."""
        if self.dim == 0:
            return replace(
                qw,
                values=shard_rows(qw.values, self.first, self.size),
                scales=shard_rows(qw.scales, self.first, self.size),
                offsets=None if qw.offsets is None else shard_rows(qw.offsets, self.first, self.size),
            )
        if qw.perm is not None:
            raise ParallelLayoutError(
                f"{name}: its input columns are permuted (act-order), so they cannot be split between "
                "tensor-parallel ranks; serve it with --dequantize-weights"
            )
        if self.first % qw.group or self.size % qw.group:
            raise ParallelLayoutError(
                f"{name}: a rank's {self.size} input columns do not fall on the weight's groups of {qw.group}; "
                "serve it with --dequantize-weights, or over fewer tensor-parallel ranks"
            )
        g0, gs = self.first // qw.group, self.size // qw.group
        return replace(
            qw,
            values=qw.values.narrow(1, self.first, self.size),
            scales=qw.scales.narrow(1, g0, gs),
            offsets=None if qw.offsets is None else qw.offsets.narrow(1, g0, gs),
        )


def shard_rows(tensor: Tensor, first: int, rows: int, dim: int = 0) -> Tensor:
    """``rows`` slices of `tensor` along `dim` from `first`, zero-padded past its end."""
    available = max(0, min(rows, tensor.shape[dim] - first))
    part = tensor.narrow(dim, first, available)
    if available == rows:
        return part
    shape = list(tensor.shape)
    shape[dim] = rows
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, available).copy_(part)
    return padded


@dataclass(frozen=True)
class PipelineStage:
    """The layers this process runs, ``layers`` of the model's, as stage ``index`` of ``size``."""

    index: int = 0
    size: int = 1
    layers: range | None = None
    """None: all of them, or (several stages) the `partition_layers` share, by `resolve`."""
    counts: tuple[int, ...] | None = None
    """Layers per stage, overriding the even partition (``SONAR_PP_LAYER_PARTITION``)."""

    def resolve(self, num_layers: int) -> "PipelineStage":
        """This stage with its `layers` set, for a model of `num_layers`."""
        if self.layers is not None or self.size == 1:
            return self
        counts = list(self.counts) if self.counts is not None else None
        return replace(self, layers=partition_layers(num_layers, self.size, counts)[self.index])

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def owned(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers


WHOLE = PipelineStage()


def partition_layers(num_layers: int, size: int, counts: list[int] | None = None) -> list[range]:
    """The layers of each of `size` stages: `counts` when given (``SONAR_PP_LAYER_PARTITION``),
    else as even as they come, the first stages taking one more where they do not divide."""
    if counts is None:
        base, extra = divmod(num_layers, size)
        counts = [base + (1 if i < extra else 0) for i in range(size)]
    if len(counts) != size or sum(counts) != num_layers or min(counts) < 1:
        raise ParallelLayoutError(
            f"--pipeline-parallel-size {size}: a partition of the model's {num_layers} layers needs {size} "
            f"positive counts summing to {num_layers}, got {counts}"
        )
    starts = [sum(counts[:i]) for i in range(size)]
    return [range(start, start + n) for start, n in zip(starts, counts)]
