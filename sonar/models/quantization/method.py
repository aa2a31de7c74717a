"""What every checkpoint quantization method provides (`Method`), and the conversions they share
into the logical layout of `sonar.kernels.quant`.

A checkpoint stores a quantized linear layer ``<module>`` as several tensors ``<module>.<part>``
(GPTQ's ``qweight``, ``qzeros``, ``scales``, ``g_idx``; FP8's ``weight`` and ``weight_scale_inv``;
...). A `Method` names the parts it reads, tells from the parts a module has whether the module is
stored quantized, and converts one module's parts into a `QuantizedWeight`, exactly: the layout's
``values * scales + offsets`` is, element for element, the format's own dequantization formula
evaluated in float32.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from sonar.kernels.quant import QuantizedWeight, dequantize
from sonar.models.decoder import QUANTIZED
from sonar.models.errors import ModelLoadError

#: The Hugging Face names of the linear layers of the decoders Sonar serves, the only modules a
#: checkpoint may store quantized (q/k/v and gate/up are fused on install): attention, the dense
#: MLP, and the mixture-of-experts families' experts and shared experts (Mixtral's experts as its
#: checkpoints name them, ``block_sparse_moe.experts.E.w1`` / ``w3`` / ``w2``). Routers stay plain.
LINEAR_MODULE = re.compile(
    r"(model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.|experts\.\d+\.)?(gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123])|lm_head)"
)


class Method(ABC):
    """One checkpoint quantization method, with the settings its config gave."""

    #: ``quantization_config.quant_method`` (and the ``--quantization`` value) of the method
    name: str
    #: the tensor suffixes a quantized module's tensors carry
    parts: frozenset[str]
    #: the modules the method may find quantized, and what they are (for the refusal)
    modules: re.Pattern[str] = LINEAR_MODULE
    serves = "quantized linear layers"
    #: the feature a decoder family must not refuse to be loaded with it (`DecoderForCausalLM.refused`)
    feature = QUANTIZED

    @abstractmethod
    def quantized(self, module: str, parts: set[str]) -> bool:
        """Whether `module`, whose checkpoint tensors ``<module>.<part>`` for `parts` (those of
        `self.parts`) exist, is stored quantized. Raises ModelLoadError where the checkpoint
        contradicts the config (a module the config leaves unquantized stored quantized)."""

    @abstractmethod
    def convert(self, module: str, tensors: dict[str, Tensor]) -> QuantizedWeight:
        """One quantized module's tensors (by part) as a `QuantizedWeight`; ModelLoadError when a
        part is missing or malformed."""

    @abstractmethod
    def describe(self) -> dict[str, object]:
        """The settings in force, for the load log."""

    def converted(self, module: str, tensors: dict[str, Tensor]) -> dict[str, QuantizedWeight]:
        """One quantized module's tensors as the quantized layers they hold, by layer name."""
        return {module: self.convert(module, tensors)}

    def dequantized(self, module: str, tensors: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        """One quantized module's tensors as the dense weights ``model.load_weights`` reads
        (``--dequantize-weights``), float32."""
        yield f"{module}.weight", dequantize(self.convert(module, tensors))


class PackedIntMethod(Method):
    """GPTQ and AWQ: a module is quantized when it stores a ``qweight``, and its config's
    ``modules_to_not_convert`` (in `skip`) must not name it."""

    skip: list[str]

    def quantized(self, module: str, parts: set[str]) -> bool:
        if "qweight" not in parts:
            return False
        if listed(module, self.skip):
            raise ModelLoadError(f"{module} is in modules_to_not_convert, but the checkpoint stores it quantized")
        return True


def need(tensors: dict[str, Tensor], module: str, part: str) -> Tensor:
    """``<module>.<part>``, or a ModelLoadError naming it."""
    tensor = tensors.get(part)
    if tensor is None:
        raise ModelLoadError(f"quantized module {module} lacks its {part} tensor")
    return tensor


def check_shape(tensor: Tensor, shape: tuple[int, ...], module: str, part: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"{module}.{part} has shape {tuple(tensor.shape)}, expected {shape}")


def listed(module: str, fragments: Iterable[str]) -> bool:
    """Whether `module` is named by a ``modules_to_not_convert`` style list: each entry a name or
    a fragment of names (transformers matches by substring)."""
    return any(fragment and fragment in module for fragment in fragments)


def group_scales(scale: Tensor, n: int, k: int, module: str, part: str = "weight_scale") -> tuple[Tensor, int]:
    """A scale tensor of any granularity as ``[N, K // group]`` float32 and its group: one scalar
    (per tensor), ``[N]`` or ``[N, 1]`` (per output channel), ``[N, G]`` (per group of K // G)."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, 1).contiguous(), k
    if s.dim() == 1 and s.shape[0] == n:
        return s.reshape(n, 1), k
    if s.dim() == 2 and s.shape[0] == n and k % s.shape[1] == 0:
        return s.contiguous(), k // s.shape[1]
    raise ModelLoadError(
        f"{module}.{part} has shape {tuple(scale.shape)}; for a [{n}, {k}] weight Sonar reads one scale, "
        f"one per output row or [{n}, G] scales with G dividing {k}"
    )


def block_scales(scale: Tensor, n: int, k: int, block: tuple[int, int], module: str, part: str) -> tuple[Tensor, int]:
    """Scales of ``[bn, bk]`` weight blocks (``[ceil(N / bn), ceil(K / bk)]``) as ``[N, K // group]``
    float32 row scales: group ``gcd(bk, K)`` keeps every group inside one block, also when the last
    block is partial."""
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    check_shape(scale, expected, module, part)
    group = math.gcd(bk, k)
    rows = torch.arange(n) // bn
    cols = torch.arange(k // group) * group // bk
    return scale.to(torch.float32)[rows][:, cols].contiguous(), group


def act_order(g_idx: Tensor, k: int, group: int, module: str) -> Tensor | None:
    """The input permutation that sorts columns by group (GPTQ's act-order), None when they are in
    order already. Every group must hold exactly `group` columns: the layout's groups are runs of
    `group` stored columns."""
    if tuple(g_idx.shape) != (k,):
        raise ModelLoadError(f"{module}.g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
    groups = k // group
    g = g_idx.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ModelLoadError(f"{module}.g_idx names groups outside 0..{groups - 1}")
    if not torch.equal(torch.bincount(g, minlength=groups), torch.full((groups,), group)):
        raise ModelLoadError(
            f"{module}.g_idx does not assign {group} input columns to each of its {groups} groups; "
            "Sonar serves act-order layouts whose groups are all of the group size"
        )
    perm = torch.argsort(g, stable=True)
    return None if torch.equal(perm, torch.arange(k)) else perm


def from_unsigned(
    fields: Tensor, bits: int, scales: Tensor, zeros: Tensor | int, group: int, perm: Tensor | None = None
) -> QuantizedWeight:
    """``w = (q - z) * s`` for unsigned `bits`-bit ``q`` (`fields` ``[N, K]``, columns in stored
    order), zero points `zeros` (``[N, K // group]`` or one number) and `scales` ``[N, K // group]``
    float32, as the layout holds it.

    4-bit: the unsigned values and offsets ``-z * s``; 8-bit: int8 values ``q - 128`` and offsets
    ``(128 - z) * s``, none when every zero point is 128. Both exact: a zero point times a 16-bit
    float scale fits float32's 24-bit mantissa, and so does their sum with ``q * s``.
    """
    if bits == 4:
        z = torch.as_tensor(zeros, dtype=torch.float32).expand_as(scales)
        return QuantizedWeight("int4", fields.to(torch.uint8), scales, -(z * scales), group, perm)
    if bits == 8:
        shift = 128 - torch.as_tensor(zeros, dtype=torch.float32).expand_as(scales)
        offsets = None if bool((shift == 0).all()) else shift * scales
        return QuantizedWeight("int8", (fields - 128).to(torch.int8), scales, offsets, group, perm)
    raise ModelLoadError(f"{bits}-bit integer weights are not supported (4 or 8)")
