"""Linear layers with their weights prepacked: the fast CPU matmul path, without compiling.

bfloat16 weights on an x86 CPU with AVX512-BF16 or AVX2 are packed for Sonar's own kernel
(``torch.ops.sonar_cpu.linear_bf16``, `sonar.kernels.native`): tiles of 16 output columns
contiguous along the input dimension, read once per step. On SmolLM2-135M's layer shapes, 2 cores
of an AMD EPYC with AVX512-BF16, it measured ~1.7x faster than oneDNN's packed path at batch 1 (the
weights stream at ~26 GB/s), ~1.2x at batch 16 and ~1.1x at prefill sizes (512-2048 rows) than
``F.linear``; it serves every row count. On an AVX2-only CPU, where oneDNN has no bfloat16 path
and ``F.linear`` widens the weight on every call, its AVX2 path is what makes bfloat16 serving
fast at all (BENCHMARKS.md, "AVX2"). On a CPU with AMX (Intel Xeon since Sapphire Rapids) the same kernel runs
products of `amx_rows` rows or more on the tile unit, reading the same packed weight (its layout is
AMX's B-tile layout): on 2 cores of such a Xeon ~3-4x faster than its AVX-512 path and 1.5-4x
faster than ``F.linear`` (oneDNN on AMX, which copies the weight per call) from 4 to 128 rows, and
~1.2x at 1024; from `ONEDNN_AMX_ROWS` rows (prefills), where oneDNN's blocking measured ~1.2x
faster, products go to ``F.linear`` (`onednn_serves`; BENCHMARKS.md, "AMX"). Elsewhere (float16,
no AVX2, the native kernels off) the oneDNN packing below is used where oneDNN runs.

Eager ``F.linear`` on a bfloat16 weight makes oneDNN reorder (copy) the weight into its blocked
layout on every call; for the small batches of decoding that copy costs more than the matmul
(SmolLM2-135M's linears: ~33 ms per decode step eager, ~18 ms prepacked, on 2 cores). This is
what ``torch.compile`` with inductor freezing does to a linear layer, done once at load time
instead: `prepack_linears` replaces every ``nn.Linear`` of a module by a `PackedLinear` that keeps
the original parameters (names, tying and loading are unchanged) beside a packed copy of the
weight, and calls oneDNN's ``_linear_pointwise`` on it.

A weight in Sonar's layout is then held once: the packed copy is all the kernel reads, so the
``[N, K]`` parameter gives up its memory (it stays, on the meta device, for its name, shape and
dtype; any arithmetic on it fails loudly) and is unpacked again only where something needs it:
a weight update writes into the parameters (`materialized`), a product the kernel does not take
(`packed_forward`). It is kept where it is read on every call: tied to another parameter (an LM
head on the embeddings), or on a CPU with AMX, whose prefill-sized products go to oneDNN on it,
or when the caller asks (a compiled forward pass, whose graph takes it as an input). For a 7B
bfloat16 model that is ~13 GB less; the packed layout itself is not negotiable: a kernel over the
plain row-major weight measured 1.4x slower at batch 1 and 1.5-1.9x at 4-64 rows on SmolLM2's
layers (its rows are too short for the prefetcher, and every output needs a horizontal sum).

Only half-precision weights on CPU are packed (oneDNN's low-precision path); float32 keeps
``F.linear``, whose MKL GEMM is already packed per call and gives the exact reference numerics.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sonar.kernels import hugepages, native

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
#: Above this many rows (a prefill) the matmul, not the weight copy, dominates, and the weight
#: packed for decode-sized batches measured no faster (up to ~10 % slower at 2048 rows) than
#: ``F.linear``, which packs for the actual shape.
PACKED_MAX_ROWS = 256


#: From this many rows a bfloat16 product on a CPU with AMX goes to oneDNN (``F.linear`` on the
#: layer's own weight), not to the native kernel's AMX path: at prefill sizes oneDNN's blocking
#: wins. SmolLM2-135M's four layer products, 2 cores of a Xeon with AMX: native 2.83 ms, oneDNN
#: 3.33 ms at 1024 rows; native 5.71 ms, oneDNN 4.76 ms at 2048 (BENCHMARKS.md, "AMX").
ONEDNN_AMX_ROWS = 1536

_generation = 0


def pack_generation() -> int:
    """A count of the packings made in this process: code that keeps references to packed weights
    (`sonar.models.fused`) rebuilds them when it changes."""
    return _generation


def count_packing() -> None:
    """Record a packing made elsewhere (a quantized layer's, `sonar.kernels.quant_linear`)."""
    global _generation
    _generation += 1


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's low-precision path runs on this CPU: its bfloat16 path needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT, its float16 path AVX512-FP16 or AVX-NE-CONVERT; on an AVX2-only CPU its
    weight reorder raises, and ``F.linear`` is what serves."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def onednn_serves(rows: int) -> bool:
    """Whether a bfloat16 product of `rows` rows over a natively packed weight goes to ``F.linear``
    (oneDNN on AMX) rather than to the native kernel: from `ONEDNN_AMX_ROWS` rows, on AMX."""
    return rows >= ONEDNN_AMX_ROWS and native.amx_bf16()


def amx_rows() -> int:
    """From how many rows ``linear_bf16`` runs on AMX tiles here; 0 where it never does (no AMX,
    the kernel refused the tile state, the native kernels off or not built)."""
    return int(torch.ops.sonar_cpu.linear_amx_rows()) if can_pack_native_dtype() else 0


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN can prepack this weight here (a CPU half-precision matrix, on a CPU whose
    instructions its low-precision path needs)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKABLE_DTYPES
        and weight.dim() == 2
        and (can_pack_native(weight) or _onednn_packs(weight.dtype))
    )


@functools.cache
def _linear_bf16_built() -> bool:
    return native.available() and bool(torch.ops.sonar_cpu.has_linear_bf16())


def can_pack_native_dtype() -> bool:
    """Whether Sonar's bf16 kernel is built and enabled here."""
    return native.enabled() and _linear_bf16_built()


def can_pack_native(weight: Tensor) -> bool:
    """Whether Sonar's bf16 kernel serves this weight: a CPU bfloat16 matrix with an even number of
    columns, on a CPU with AVX512-BF16 or AVX2, the native kernels enabled."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and can_pack_native_dtype()
    )


def native_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    """The shape of a ``[out_features, in_features]`` weight packed for ``linear_bf16``."""
    return (-(-out_features // 16), in_features // 2, 16, 2)


def pack_native(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """``weight`` ``[N, K]`` as ``linear_bf16`` reads it: ``[ceil(N / 16), K / 2, 16, 2]``, the
    last tile's missing columns zero; written into `out` (contiguous, of that shape and dtype)
    when given, so a caller that placed it (`prepack_linears`: on huge pages) pays one copy."""
    n, k = weight.shape
    tiles, full = -(-n // 16), n // 16
    if out is None:
        out = torch.empty(native_shape(n, k), dtype=weight.dtype)
    # Two consecutive k of one column are one 4-byte unit in both layouts: packing is a transpose
    # of [tiles, 16, K / 2] units, which copies ~2.5x faster than permuting 2-byte elements.
    units = out.view(torch.int32).view(tiles, k // 2, 16)
    source = weight.contiguous().view(torch.int32)
    units[:full].copy_(source[: full * 16].view(full, 16, k // 2).transpose(1, 2))
    if full < tiles:
        units[full].zero_()
        units[full, :, : n - full * 16].copy_(source[full * 16 :].t())
    return out


def unpack_native(packed: Tensor, out_features: int) -> Tensor:
    """The ``[out_features, K]`` weight `pack_native` packed into `packed` (a fresh tensor)."""
    tiles, pairs = packed.shape[0], packed.shape[1]
    units = packed.view(torch.int32).view(tiles, pairs, 16).transpose(1, 2).reshape(tiles * 16, pairs)
    weight = torch.empty(out_features, pairs, dtype=torch.int32)  # strides of its own, even at K = 2
    return weight.copy_(units[:out_features]).view(packed.dtype)


def plain_weight(weight: Tensor, packed: Tensor) -> Tensor:
    """`weight` itself, or unpacked from `packed` where it was given up (on the meta device)."""
    return unpack_native(packed, weight.shape[0]) if weight.is_meta else weight


def packed_forward(x: Tensor, weight: Tensor, packed: Tensor, bias: Tensor | None, native_layout: bool) -> Tensor:
    """`PackedLinear`'s arithmetic on its tensors (also what the compiled model's opaque operator
    runs): the native kernel on its layout (``F.linear`` where `onednn_serves` the rows), oneDNN on
    its own up to `PACKED_MAX_ROWS` rows, ``F.linear`` for anything else. Leading dimensions are
    flattened into rows. A `weight` on the meta device (given up: `PackedLinear.drop_weight`) is
    unpacked from `packed` where ``F.linear`` needs it."""
    if x.dim() > 2 and x.dtype == weight.dtype:
        flat = packed_forward(x.reshape(-1, x.shape[-1]), weight, packed, bias, native_layout)
        return flat.view(*x.shape[:-1], weight.shape[0])
    if x.dim() != 2 or x.dtype != weight.dtype:
        return F.linear(x, plain_weight(weight, packed), bias)
    if native_layout:
        if onednn_serves(x.shape[0]):
            return F.linear(x, plain_weight(weight, packed), bias)
        return torch.ops.sonar_cpu.linear_bf16(x.contiguous(), packed, bias, weight.shape[0])
    if x.shape[0] > PACKED_MAX_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` over a packed copy of ``weight`` (Sonar's layout where
    `can_pack_native`, oneDNN's otherwise: ``native_layout`` says which).

    ``weight`` and ``bias`` stay the original parameters (so ``state_dict`` names and tied
    weights are unchanged; a weight given up is a new parameter of the same name, shape and
    dtype); the packed copy is a non-persistent buffer, made once. Change the
    weight afterwards and the layer does not see it: call `repack`. In Sonar's layout the weight's
    memory can be given up (`drop_weight`) and restored from the packed copy (`restore_weight`).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int, into: Tensor | None = None) -> None:
        """`into`: where to write the packed weight in Sonar's layout (`native_shape`), or None
        to allocate it."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.native_layout = can_pack_native(self.weight)
        self.register_buffer("packed", self._pack(into), persistent=False)

    def _pack(self, into: Tensor | None = None) -> Tensor:
        count_packing()
        if self.native_layout:
            return pack_native(self.weight.detach(), into)
        return torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)

    def repack(self) -> None:
        """Pack the weight again (after it changed): in place in Sonar's layout, so the packed
        weight stays where `prepack_linears` put it."""
        if self.weight.is_meta:
            raise RuntimeError("PackedLinear.repack: the weight was given up; restore_weight first")
        self.packed = self._pack(self.packed if self.native_layout else None)

    def drop_weight(self) -> None:
        """Give up the ``[N, K]`` weight's memory, keeping the parameter (on the meta device) for
        its name, shape and dtype: the packed copy serves every product. Sonar's layout only; the
        caller makes sure nothing else holds the parameter (a tied weight)."""
        if not self.native_layout:
            raise RuntimeError("PackedLinear.drop_weight: only a weight in Sonar's layout can be unpacked again")
        if not self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def restore_weight(self) -> None:
        """The ``[N, K]`` weight again, unpacked from the packed copy (after `drop_weight`)."""
        if self.weight.is_meta:
            self.weight = nn.Parameter(plain_weight(self.weight, self.packed), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return packed_forward(x, self.weight, self.packed, self.bias, self.native_layout)

    def extra_repr(self) -> str:
        layout = "native" if self.native_layout else "onednn"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {layout}"
        )


def prepack_linears(module: nn.Module, batch_hint: int = 16, keep_weights: bool = False) -> int:
    """Replace, in place, every packable ``nn.Linear`` under `module` by a `PackedLinear`.

    `batch_hint` is the row count oneDNN tunes its layout for; any row count works. A weight packed
    in Sonar's layout gives up its ``[N, K]`` memory, unless `keep_weights`, it is tied to another
    parameter of `module`, or oneDNN takes this CPU's prefill-sized products on it (AMX). Returns
    the number of layers replaced.
    """
    found = [
        (parent, name, child)
        for parent in list(module.modules())
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight)
    ]
    # a decode step streams every packed weight once: those in Sonar's layout side by side on huge
    # pages, each packed straight into its place there
    shapes = [native_shape(*child.weight.shape) for _, _, child in found if can_pack_native(child.weight)]
    places = iter(hugepages.arena(shapes, torch.bfloat16))
    holders = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    keep = keep_weights or native.amx_bf16()
    replaced = len(found)
    # Each weight is given up as soon as it is packed, and nothing here holds a replaced layer
    # after its turn: the load's peak holds one weight twice, not every weight.
    found.reverse()
    while found:
        parent, name, child = found.pop()
        shared = holders[id(child.weight)] > 1
        packed = PackedLinear(child, batch_hint, next(places) if can_pack_native(child.weight) else None)
        setattr(parent, name, packed)
        del child
        if packed.native_layout and not keep and not shared:
            packed.drop_weight()
    return replaced


@contextlib.contextmanager
def materialized(module: nn.Module) -> Iterator[None]:
    """Inside: every `PackedLinear` under `module` holds its ``[N, K]`` weight (a weight update
    writes into the parameters; it repacks what it changed before leaving). On the way out the
    weights given up on the way in are given up again."""
    dropped = [m for m in module.modules() if isinstance(m, PackedLinear) and m.weight.is_meta]
    for layer in dropped:
        layer.restore_weight()
    try:
        yield
    finally:
        for layer in dropped:
            layer.drop_weight()
