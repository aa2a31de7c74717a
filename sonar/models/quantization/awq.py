"""AWQ checkpoints (AutoAWQ, GEMM version): 4-bit integer weights with per-group scales and zero
points.

A quantized linear ``[N, K]`` is stored as

* ``qweight`` int32 ``[K, N / 8]``: the values packed along the output axis, eight to a word in
  AWQ's interleaved order (`sonar.models.quantization.packing.AWQ_FIELD`);
* ``qzeros`` int32 ``[K / G, N / 8]``: the zero points, packed the same way;
* ``scales`` float16 ``[K / G, N]``;

and dequantizes as ``w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]`` (no offset on the zero
point, unlike GPTQ's v1 format).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.method import PackedIntMethod, check_shape, from_unsigned, need
from sonar.models.quantization.packing import awq_columns, unpack_int32

GROUP_SIZES = (32, 64, 128, -1)


class AWQ(PackedIntMethod):
    name = "awq"
    parts = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, group_size: int, skip: list[str]) -> None:
        self.group_size = group_size
        self.skip = skip

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> AWQ:
        version = str(qc.get("version") or qc.get("checkpoint_format") or "gemm").lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported (Sonar reads the gemm layout)")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ModelLoadError(f"AWQ bits {bits!r} is not supported (4)")
        group = qc.get("group_size", qc.get("q_group_size"))
        if group not in GROUP_SIZES:
            raise ModelLoadError(
                f"AWQ group_size {group!r} is not supported ({', '.join(map(str, GROUP_SIZES))}; -1: one group per row)"
            )
        if qc.get("zero_point", True) is not True:
            raise ModelLoadError("AWQ zero_point false is not supported (Sonar reads AWQ's asymmetric layout)")
        return cls(group, list(qc.get("modules_to_not_convert") or []))

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = (need(tensors, module, p) for p in ("qweight", "qzeros", "scales"))
        k, n = qweight.shape[0], qweight.shape[1] * 8
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ModelLoadError(f"{module}: AWQ group_size {group} does not divide its {k} input features")
        check_shape(scales, (k // group, n), module, "scales")
        check_shape(qzeros, (k // group, n // 8), module, "qzeros")
        q = awq_columns(unpack_int32(qweight, 4, dim=1))  # [K, N]
        z = awq_columns(unpack_int32(qzeros, 4, dim=1))  # [K / G, N]
        return from_unsigned(q.T, 4, scales.to(torch.float32).T.contiguous(), z.T, group)

    def describe(self) -> dict[str, object]:
        return {"bits": 4, "group_size": self.group_size, "version": "gemm"}
