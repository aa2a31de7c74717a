"""Linear layers with their weights prepacked for oneDNN: the fast CPU matmul path, without compiling.

Eager ``F.linear`` on a bfloat16 weight makes oneDNN reorder (copy) the weight into its blocked
layout on every call; for the small batches of decoding that copy costs more than the matmul
(SmolLM2-135M's linears: ~33 ms per decode step eager, ~18 ms prepacked, on 2 cores). This is
what ``torch.compile`` with inductor freezing does to a linear layer, done once at load time
instead: `prepack_linears` replaces every ``nn.Linear`` of a module by a `PackedLinear` that keeps
the original parameters (names, tying and loading are unchanged) beside a packed copy of the
weight, and calls oneDNN's ``_linear_pointwise`` on it.

Only half-precision weights on CPU are packed (oneDNN's low-precision path); float32 keeps
``F.linear``, whose MKL GEMM is already packed per call and gives the exact reference numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
#: Above this many rows (a prefill) the matmul, not the weight copy, dominates, and the weight
#: packed for decode-sized batches measured no faster (up to ~10 % slower at 2048 rows) than
#: ``F.linear``, which packs for the actual shape.
PACKED_MAX_ROWS = 256


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN can prepack this weight here (a CPU half-precision matrix)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKABLE_DTYPES
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` over a oneDNN-packed copy of ``weight``.

    ``weight`` and ``bias`` stay the original parameters (so ``state_dict`` names and tied
    weights are unchanged); the packed copy is a non-persistent buffer, made once. Change the
    weight afterwards and the layer does not see it: call `repack`.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.register_buffer("packed", self._pack(), persistent=False)

    def _pack(self) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)

    def repack(self) -> None:
        self.packed = self._pack()

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.dtype != self.weight.dtype or x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(module: nn.Module, batch_hint: int = 16) -> int:
    """Replace, in place, every packable ``nn.Linear`` under `module` by a `PackedLinear`.

    `batch_hint` is the row count oneDNN tunes the layout for; any row count works. Returns the
    number of layers replaced.
    """
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                setattr(parent, name, PackedLinear(child, batch_hint))
                replaced += 1
    return replaced
