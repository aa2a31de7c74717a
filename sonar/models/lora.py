"""Linear layers that add, to each row of a flat batch, the delta of that row's LoRA adapter.

A targeted linear keeps its base layer (plain, packed or quantized: whatever the loader made) and
gains one device slot per adapter a step may use (``--max-loras``): ``a[s]`` stacks the shrink
matrices of slot ``s`` for each of the layer's sub-projections (q, k, v of the fused ``qkv_proj``;
gate, up of ``gate_up_proj``; one for ``o_proj`` and ``down_proj``), ``b[s]`` their expand
matrices, already multiplied by the adapter's scaling. A step's rows say which slot each uses
(`LoRAContext`); rows with no adapter (-1) get the base output alone. The work is one batched
kernel per layer (`sonar.kernels.lora`), never a forward pass per adapter. Where the native CPU
kernel reads B packed (bfloat16), the layer keeps ``b_packed`` beside ``b`` and packs it again
whenever ``b`` was written since (its version counter), so no step packs B itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from sonar.kernels import lora as lora_kernels
from sonar.models.parallel import TensorParallel


class LoRAContext:
    """The slot of each row of the step being run, shared by every `LoRALinear` of a model.

    The runner runs each forward pass inside `step`; a pass outside one, or whose rows have no
    adapter, leaves the base layers alone."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: Tensor | None = None
        """The slot of each row of the forward pass running now; None when no row has an adapter."""

    @contextlib.contextmanager
    def step(self, slots: list[int]) -> Iterator[None]:
        """Within: forward passes whose row ``i`` uses adapter slot ``slots[i]`` (-1: none)."""
        self.rows = torch.tensor(slots, dtype=torch.int64, device=self.device) if any(s >= 0 for s in slots) else None
        try:
            yield
        finally:
            self.rows = None


class LoRALinear(nn.Module):
    """`base` plus the delta of each row's adapter slot; ``splits``: the output sizes of the
    sub-projections (``[q, kv, kv]`` for ``qkv_proj``), in the order of the base's columns.

    Each sub-projection has `a_rank` rows of ``a`` (`max_rank` unless a subclass shards them) and
    ``b`` has `b_rows` rows (the base's output columns unless a subclass shards them)."""

    packs_b = True
    """Whether `forward` runs `lora_kernels.lora_add` (which may read B packed)."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        splits: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        context: LoRAContext,
        *,
        a_rank: int | None = None,
        b_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.splits = splits
        self.rank = max_rank
        self.a_rank = max_rank if a_rank is None else a_rank
        self.context = context
        device = context.device
        shape_a = (max_loras, len(splits) * self.a_rank, in_features)
        shape_b = (max_loras, sum(splits) if b_rows is None else b_rows, max_rank)
        with torch.inference_mode(False):  # tensors whose writes bump their version counters
            self.register_buffer("a", torch.zeros(shape_a, dtype=dtype, device=device), False)
            self.register_buffer("b", torch.zeros(shape_b, dtype=dtype, device=device), False)
            packed = lora_kernels.pack_b(self.b, splits) if self.packs_b and lora_kernels.packs_b(self.b) else None
            self.register_buffer("b_packed", packed, False)
        self._packed_version = self.b._version

    def packed_b(self) -> Tensor | None:
        """``b`` as the native kernel reads it (`lora_kernels.pack_b`; None where it reads ``b``),
        packed again in place when ``b`` was written since it was last packed."""
        if self.b_packed is not None and self.b._version != self._packed_version:
            self.b_packed.copy_(lora_kernels.pack_b(self.b, self.splits))
            self._packed_version = self.b._version
        return self.b_packed

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        rows = self.context.rows
        if rows is not None:
            lora_kernels.lora_add(y, x, self.a, self.b, rows, self.splits, self.packed_b())
        return y


class ShardedLoRALinear(LoRALinear):
    """``--fully-sharded-loras``: a layer of a tensor-parallel group (`parallel`) whose forward
    pass exchanges the shrink's result between the ranks."""

    packs_b = False

    def __init__(self, *args: Any, parallel: TensorParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = parallel


class ColumnShardedLoRALinear(ShardedLoRALinear):
    """A column-parallel layer (q/k/v, gate/up): a rank holds ``1 / size`` of each adapter's rank
    (rows of A), so the shrink is split over the ranks too; their parts of its result are gathered
    before the expand, whose B rows are this rank's output columns (as the base layer's are)."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        rows = self.context.rows
        if rows is not None:
            part = lora_kernels.shrink(x, self.a, rows)  # [n, subs * a_rank]
            n, subs = x.shape[0], len(self.splits)
            gathered = self.parallel.gather_last(part)  # rank by rank, each its subs' rank slices
            t = gathered.view(n, self.parallel.size, subs, self.a_rank).transpose(1, 2).reshape(n, subs * self.rank)
            lora_kernels.expand(y, t, self.b, rows, self.splits)
        return y


class RowShardedLoRALinear(ShardedLoRALinear):
    """A row-parallel layer (o, down): the shrink of this rank's input columns is summed over the
    ranks, and the expand computes only this rank's ``1 / size`` of the output columns (rows of B),
    added to the base layer's partial output there: the layer's all-reduce then sums the whole
    delta."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        rows = self.context.rows
        if rows is not None:
            t = self.parallel.all_reduce(lora_kernels.shrink(x, self.a, rows))
            width = self.b.shape[1]
            lora_kernels.expand(y.narrow(1, self.parallel.rank * width, width), t, self.b, rows, (width,))
        return y
