"""Tensor parallelism: how a decoder's weights split over the ranks of a group, and its collectives.

Megatron's layout, with torch.distributed for every collective (gloo on the CPU, NCCL on GPUs):

* q/k/v and gate/up are *column*-parallel: each rank holds the output rows of its attention heads
  and its slice of the intermediate size, and computes them without talking to the others;
* o_proj and down_proj are *row*-parallel: each rank multiplies its slice of the input columns,
  and one all-reduce sums the partial outputs (their biases live on rank 0 alone, so the sum
  adds them once);
* the embedding and the LM head are *vocab*-parallel: each rank holds ``ceil(vocab / size)`` rows
  (the last one zero-padded); an embedding lookup zeroes the ids outside the rank's rows and
  all-reduces, the LM head's logits are all-gathered along the vocabulary.

KV heads split like query heads; with fewer KV heads than ranks each KV head is replicated on
``size / num_kv_heads`` consecutive ranks (the ones whose query heads read it), so the KV cache of
a rank always holds whole heads. Norms, rotary tables and per-head q/k norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sonar.models.errors import ModelLoadError


class ParallelLayoutError(ModelLoadError):
    """The model's shapes do not split over the requested number of ranks."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; ``size`` 1 (`SINGLE`) is no parallelism.

    `group` is the torch.distributed process group (None: the default one); `device` where its
    collectives take their tensors (CUDA for NCCL)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    device: str = "cpu"

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

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' `value`s."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast(self, x: Tensor) -> Tensor:
        """Rank 0's `x`, on every rank (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.group)
        return x


SINGLE = TensorParallel()


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
