"""Linear layers that add, to each row of a flat batch, the delta of that row's LoRA adapter.

A targeted linear keeps its base layer (plain, packed or quantized: whatever the loader made) and
gains one device slot per adapter a step may use (``--max-loras``): ``a[s]`` stacks the shrink
matrices of slot ``s`` for each of the layer's sub-projections (q, k, v of the fused ``qkv_proj``;
gate, up of ``gate_up_proj``; one for ``o_proj`` and ``down_proj``), ``b[s]`` their expand
matrices, already multiplied by the adapter's scaling. A step's rows say which slot each uses
(`LoRAContext`); rows with no adapter (-1) get the base output alone. The work is one batched
kernel per layer (`sonar.kernels.lora`), never a forward pass per adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from sonar.kernels import lora as lora_kernels


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
    sub-projections (``[q, kv, kv]`` for ``qkv_proj``), in the order of the base's columns."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        splits: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        context: LoRAContext,
    ) -> None:
        super().__init__()
        self.base = base
        self.splits = splits
        self.rank = max_rank
        self.context = context
        device = context.device
        self.register_buffer(
            "a", torch.zeros(max_loras, len(splits) * max_rank, in_features, dtype=dtype, device=device), False
        )
        self.register_buffer("b", torch.zeros(max_loras, sum(splits), max_rank, dtype=dtype, device=device), False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        rows = self.context.rows
        if rows is not None:
            lora_kernels.lora_add(y, x, self.a, self.b, rows, self.splits)
        return y
