"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): 4- or 8-bit integer weights with per-group
scales and zero points, optionally in act-order.

A quantized linear ``[N, K]`` is stored as

* ``qweight`` int32 ``[K * bits / 32, N]``: the values packed along the input axis, word ``i`` of
  column ``n`` holding rows ``i * 32 / bits ...`` lowest bits first;
* ``qzeros`` int32 ``[K / G, N * bits / 32]``: the zero points packed along the output axis;
* ``scales`` ``[K / G, N]`` (float16, or bfloat16);
* ``g_idx`` int32 ``[K]`` (optional): the group of each input column, out of order with act-order
  (``desc_act``).

and dequantizes as ``w[n, k] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]``. The original
format (``checkpoint_format`` ``gptq``, "v1") stores every zero point minus one, so ``z`` is the
stored field plus one; ``gptq_v2`` stores ``z`` itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.method import PackedIntMethod, act_order, check_shape, from_unsigned, need
from sonar.models.quantization.packing import unpack_int32

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128, -1)
FORMATS = ("gptq", "gptq_v2")


class GPTQ(PackedIntMethod):
    name = "gptq"
    parts = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_plus_one: bool, skip: list[str]) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.zero_plus_one = zero_plus_one
        self.skip = skip

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GPTQ:
        bits = qc.get("bits")
        if bits not in BITS:
            raise ModelLoadError(f"GPTQ bits {bits!r} is not supported (Sonar serves {', '.join(map(str, BITS))})")
        group = qc.get("group_size", 128)
        if group not in GROUP_SIZES:
            raise ModelLoadError(
                f"GPTQ group_size {group!r} is not supported ({', '.join(map(str, GROUP_SIZES))}; -1: one group per row)"
            )
        fmt = qc.get("checkpoint_format", "gptq")
        if qc.get("is_marlin_format") or fmt not in FORMATS:
            shown = "marlin" if qc.get("is_marlin_format") else fmt
            raise ModelLoadError(
                f"GPTQ checkpoint_format {shown!r} is not supported (Sonar reads {' and '.join(FORMATS)})"
            )
        pack = qc.get("pack_dtype", "int32")
        if pack != "int32":
            raise ModelLoadError(f"GPTQ pack_dtype {pack!r} is not supported (int32)")
        if qc.get("dynamic"):
            raise ModelLoadError("GPTQ per-module overrides (quantization_config.dynamic) are not supported")
        skip = list(qc.get("modules_to_not_convert") or [])
        return cls(bits, group, bool(qc.get("desc_act", False)), fmt == "gptq", skip)

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = (need(tensors, module, p) for p in ("qweight", "qzeros", "scales"))
        per = 32 // self.bits
        k, n = qweight.shape[0] * per, qweight.shape[1]
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ModelLoadError(f"{module}: GPTQ group_size {group} does not divide its {k} input features")
        groups = k // group
        check_shape(scales, (groups, n), module, "scales")
        check_shape(qzeros, (groups, -(-n // per)), module, "qzeros")
        q = unpack_int32(qweight, self.bits, dim=0)  # [K, N]
        z = unpack_int32(qzeros, self.bits, dim=1)[:, :n]  # [K / G, N]
        if self.zero_plus_one:
            z = z + 1
        g_idx = tensors.get("g_idx")
        perm = None if g_idx is None else act_order(g_idx, k, group, module)
        if perm is not None:
            q = q[perm]
        return from_unsigned(q.T, self.bits, scales.to(torch.float32).T.contiguous(), z.T, group, perm)

    def describe(self) -> dict[str, object]:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "checkpoint_format": "gptq" if self.zero_plus_one else "gptq_v2",
        }
