"""GPT-OSS's published MXFP4 checkpoints (``quant_method`` ``mxfp4``, openai/gpt-oss-20b's layout).

Only the experts are quantized. A block's ``model.layers.N.mlp.experts`` stores, per projection
(``gate_up_proj``: ``R = 2 I`` rows over ``K = h`` inputs; ``down_proj``: ``R = h`` over ``K = I``):

* ``<proj>_blocks`` uint8 ``[E, R, K / 32, 16]``: per row, 32-value groups of 16 bytes, each byte
  two E2M1 codes, the low nibble first (input column ``2 j``, then ``2 j + 1``);
* ``<proj>_scales`` uint8 ``[E, R, K / 32]``: one E8M0 exponent ``e`` per group;

and, as plain tensors, ``<proj>_bias``. Each weight is ``fp4[q] * 2^(e - 127)``, what transformers'
``convert_moe_packed_tensors`` computes (it then transposes to its ``[E, K, R]`` parameters). That
equals `sonar.kernels.quant`'s mxfp4 layout with the same codes and the same exponent bytes
(``MXFP4_VALUES`` are the E2M1 values doubled, its scales ``2^(e - 128)``), so the conversion is
exact and keeps MXFP4's 17 bytes per 32 weights. ``gate_up_proj``'s rows alternate gate and up
(transformers' interleaving): the even rows are the gate's, the odd ones the up's.

`MXFP4.converted` gives each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``, which
`sonar.models.gpt_oss.GptOssForCausalLM.prepare_quantized` serves as `QuantizedExperts` (the
native grouped operator on the CPU, the Triton one on CUDA); with ``--dequantize-weights``
`MXFP4.dequantized` gives transformers' dense parameters instead. ``modules_to_not_convert`` follows transformers' matching (`not_converted`): an
experts module it names is read as plain weights, and one stored quantized is an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight, dequantize, mxfp4_scales
from sonar.models.errors import ModelLoadError
from sonar.models.quantization.method import Method, need

GROUP = 32
PROJECTIONS = ("gate_up_proj", "down_proj")
EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts")
#: The ``model_type`` of the only family whose MXFP4 checkpoints Sonar reads.
MODEL_TYPE = "gpt_oss"


def not_converted(module: str, patterns: list[str]) -> bool:
    """Whether ``modules_to_not_convert`` names `module`, as transformers matches it: a pattern is
    a regular expression matched from the start up to a module boundary (``model.layers.*.self_attn``),
    or a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def codes(blocks: Tensor) -> Tensor:
    """``[..., G, 16]`` packed bytes -> ``[..., G * 32]`` 4-bit codes, each byte's low nibble first."""
    b = blocks.to(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-3)


class MXFP4(Method):
    """GPT-OSS's MXFP4 experts (``quant_method`` ``mxfp4``)."""

    name = "mxfp4"
    parts = frozenset(f"{proj}_{kind}" for proj in PROJECTIONS for kind in ("blocks", "scales"))
    modules = EXPERTS
    serves = "mxfp4 for GPT-OSS's experts"
    feature = "MXFP4 experts"

    def __init__(self, skip: list[str]) -> None:
        self.skip = skip

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> MXFP4:
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(p, str) for p in skip):
            raise ModelLoadError("mxfp4 quantization_config modules_to_not_convert must be a list of names")
        return cls(skip)

    def quantized(self, module: str, parts: set[str]) -> bool:
        if not_converted(module, self.skip):
            raise ModelLoadError(f"{module} is in modules_to_not_convert, but the checkpoint stores it quantized")
        return True

    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        """One projection's ``blocks`` and ``scales`` (`module` names the projection) as one
        ``[E * R, K]`` weight, the experts' rows one after the other."""
        blocks, scales = need(tensors, module, "blocks"), need(tensors, module, "scales")
        if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
            raise ModelLoadError(
                f"{module}_blocks is {blocks.dtype} {tuple(blocks.shape)}; MXFP4 blocks are uint8 [E, R, K/32, 16]"
            )
        if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ModelLoadError(
                f"{module}_scales is {scales.dtype} {tuple(scales.shape)}; expected uint8 {tuple(blocks.shape[:-1])}"
            )
        e, r, g, _ = blocks.shape
        return QuantizedWeight(
            "mxfp4", codes(blocks).reshape(e * r, g * GROUP), mxfp4_scales(scales.reshape(e * r, g)), None, GROUP
        )

    def _projections(self, module: str, tensors: dict[str, Tensor]) -> Iterator[tuple[str, int, QuantizedWeight]]:
        for proj in PROJECTIONS:
            parts = {kind: tensors[f"{proj}_{kind}"] for kind in ("blocks", "scales") if f"{proj}_{kind}" in tensors}
            count = need(tensors, module, f"{proj}_blocks").shape[0]
            yield proj, count, self.convert(f"{module}.{proj}", parts)

    def converted(self, module: str, tensors: dict[str, Tensor]) -> dict[str, QuantizedWeight]:
        """Each expert's ``gate_proj`` / ``up_proj`` (the even / odd rows of its ``gate_up_proj``)
        and ``down_proj``, as ``<module>.<e>.<name>``."""
        out: dict[str, QuantizedWeight] = {}
        for proj, count, stacked in self._projections(module, tensors):
            rows = stacked.out_features // count
            for e in range(count):
                values = stacked.values[e * rows : (e + 1) * rows]
                scales = stacked.scales[e * rows : (e + 1) * rows]
                if proj == "down_proj":
                    out[f"{module}.{e}.down_proj"] = QuantizedWeight("mxfp4", values, scales, None, GROUP)
                    continue
                for name, first in (("gate_proj", 0), ("up_proj", 1)):
                    out[f"{module}.{e}.{name}"] = QuantizedWeight(
                        "mxfp4", values[first::2].contiguous(), scales[first::2].contiguous(), None, GROUP
                    )
        return out

    def dequantized(self, module: str, tensors: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        """transformers' dense parameters: ``<module>.<proj>`` ``[E, K, R]`` float32."""
        for proj, count, stacked in self._projections(module, tensors):
            dense = dequantize(stacked)
            yield f"{module}.{proj}", dense.reshape(count, -1, dense.shape[1]).transpose(1, 2)

    def describe(self) -> dict[str, object]:
        return {"modules_to_not_convert": self.skip}
