"""Layers over quantized weights (`sonar.kernels.quant`): `QuantLinear` and `QuantEmbedding`,
each running on the backend chosen for its device.

A backend packs a `QuantizedWeight` once, at load, into the tensors its kernel reads, and keeps
nothing else: the packed tensors are the layer's only copy of the weight. Backends, first that
serves a weight wins: the native CPU kernels (`sonar.kernels.quant_cpu`), the Triton kernels on
CUDA (`sonar.kernels.quant_triton`), and the torch reference (`ReferenceBackend`, the logical
layout as it is, dequantized on every call: correct everywhere, slow).

An embedding tied to the output layer (SmolLM2, small Qwens) shares the output layer's packed
weight: `QuantEmbedding` asks the backend for the rows of the tokens it looks up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from sonar.kernels import linear, quant
from sonar.kernels.quant import QuantizedWeight


@dataclass(frozen=True)
class QuantMeta:
    """What a backend needs besides the packed tensors."""

    format: quant.Format
    out_features: int
    in_features: int
    group: int
    has_offsets: bool
    has_perm: bool


class Backend(Protocol):
    name: str

    def serves(self, qw: QuantizedWeight) -> bool:
        """Whether this backend runs `qw` (on the device its tensors are on)."""
        ...

    def pack(self, qw: QuantizedWeight) -> dict[str, Tensor]:
        """The tensors the kernel reads, made once."""
        ...

    def linear(self, x: Tensor, packed: dict[str, Tensor], meta: QuantMeta, bias: Tensor | None) -> Tensor:
        """``x [M, K] @ w.T + bias`` in ``x``'s dtype."""
        ...

    def rows(self, packed: dict[str, Tensor], meta: QuantMeta, index: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `index` of the dequantized weight, ``[len(index), K]`` in `dtype`."""
        ...


def quant_meta(qw: QuantizedWeight) -> QuantMeta:
    return QuantMeta(qw.format, qw.out_features, qw.in_features, qw.group, qw.offsets is not None, qw.perm is not None)


def pack_nibbles(values: Tensor) -> Tensor:
    """int4 values ``[N, K]`` (uint8 0..15) two per byte, ``[N, K / 2]``: column ``2j`` in the low
    nibble of byte ``j``, ``2j + 1`` in the high one."""
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


class ReferenceBackend:
    """The logical layout (int4 and mxfp4 two values per byte, mxfp4's scales as their exponent
    bytes); every call dequantizes (`sonar.kernels.quant.dequantize`)."""

    name = "reference"

    def serves(self, qw: QuantizedWeight) -> bool:
        return True

    def pack(self, qw: QuantizedWeight) -> dict[str, Tensor]:
        nibbles = qw.format in ("int4", "mxfp4")
        packed = {"values": pack_nibbles(qw.values) if nibbles else qw.values}
        if qw.format == "mxfp4":
            packed["exponents"] = quant.mxfp4_exponents(qw.scales)
        else:
            packed["scales"] = qw.scales
        if qw.offsets is not None:
            packed["offsets"] = qw.offsets
        if qw.perm is not None:
            packed["perm"] = qw.perm
        return packed

    def _weight(self, packed: dict[str, Tensor], meta: QuantMeta, index: Tensor | None = None) -> QuantizedWeight:
        values, offsets = packed["values"], packed.get("offsets")
        scales = quant.mxfp4_scales(packed["exponents"]) if meta.format == "mxfp4" else packed["scales"]
        if index is not None:
            values, scales = values[index], scales[index]
            offsets = None if offsets is None else offsets[index]
        if meta.format in ("int4", "mxfp4"):
            values = unpack_nibbles(values)
        return QuantizedWeight(meta.format, values, scales, offsets, meta.group, packed.get("perm"))

    def linear(self, x: Tensor, packed: dict[str, Tensor], meta: QuantMeta, bias: Tensor | None) -> Tensor:
        return quant.reference_linear(x, self._weight(packed, meta), bias)

    def rows(self, packed: dict[str, Tensor], meta: QuantMeta, index: Tensor, dtype: torch.dtype) -> Tensor:
        return quant.dequantize(self._weight(packed, meta, index), dtype)


def backends() -> list[Backend]:
    """The backends in the order they are tried."""
    found: list[Backend] = []
    try:
        from sonar.kernels.quant_cpu import NativeBackend
    except ImportError:
        pass
    else:
        found.append(NativeBackend())
    try:
        from sonar.kernels.quant_triton import TritonBackend
    except ImportError:
        pass
    else:
        found.append(TritonBackend())
    found.append(ReferenceBackend())
    return found


def backend_for(qw: QuantizedWeight, prefer_reference: bool = False) -> Backend:
    if prefer_reference:
        return ReferenceBackend()
    return next(b for b in backends() if b.serves(qw))


@functools.cache
def _backends_by_name() -> dict[str, Backend]:
    return {b.name: b for b in backends()}


@torch.library.custom_op("sonar::quant_linear", mutates_args=())
def quant_linear_op(
    x: Tensor,
    tensors: list[Tensor],
    names: str,
    backend: str,
    fmt: str,
    out_features: int,
    in_features: int,
    group: int,
    bias: Tensor | None,
) -> Tensor:
    """`QuantLinear.forward` as one opaque operator for ``torch.compile`` (Inductor cannot lower a
    packed weight, and the backends' kernels are not traceable): the packed tensors in order,
    their `names` comma-separated, and the backend by name."""
    keys = names.split(",")
    meta = QuantMeta(fmt, out_features, in_features, group, "offsets" in keys, "perm" in keys)  # type: ignore[arg-type]
    return _backends_by_name()[backend].linear(x, dict(zip(keys, tensors, strict=True)), meta, bias)


@quant_linear_op.register_fake
def _quant_linear_fake(
    x: Tensor,
    tensors: list[Tensor],
    names: str,
    backend: str,
    fmt: str,
    out_features: int,
    in_features: int,
    group: int,
    bias: Tensor | None,
) -> Tensor:
    return x.new_empty((x.shape[0], out_features))


class QuantLinear(nn.Module):
    """``y = x @ w.T + bias`` over a quantized weight (module names as ``nn.Linear``'s, so
    checkpoints and the fused decode path find it where they look)."""

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: Tensor | None,
        backend: Backend | None = None,
        packed: dict[str, Tensor] | None = None,
    ) -> None:
        """`packed`: what `backend` packed `qw` to before (a cache's copy), taken as it is."""
        super().__init__()
        self.in_features = qw.in_features
        self.out_features = qw.out_features
        self.meta = quant_meta(qw)
        self.backend = backend or backend_for(qw)
        self.packed_names: list[str] = []
        for name, tensor in (packed if packed is not None else self.backend.pack(qw)).items():
            self.register_buffer(f"q_{name}", tensor, persistent=False)
            self.packed_names.append(name)
        linear.count_packing()  # the fused decode path rereads the layers' weights
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def packed(self) -> dict[str, Tensor]:
        return {name: getattr(self, f"q_{name}") for name in self.packed_names}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed.values())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if torch.compiler.is_compiling():
            m = self.meta
            y = quant_linear_op(
                flat,
                list(self.packed.values()),
                ",".join(self.packed_names),
                self.backend.name,
                m.format,
                m.out_features,
                m.in_features,
                m.group,
                self.bias,
            )
        else:
            y = self.backend.linear(flat, self.packed, self.meta, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def rows(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        return self.backend.rows(self.packed, self.meta, index, dtype)

    def extra_repr(self) -> str:
        m = self.meta
        return (
            f"in_features={m.in_features}, out_features={m.out_features}, {m.format}, group={m.group}, "
            f"bias={self.bias is not None}, backend={self.backend.name}"
        )


class QuantEmbedding(nn.Module):
    """Token embeddings read from a quantized matrix ``[vocab, hidden]``: the rows of the tokens
    looked up are dequantized into `dtype`. `source` may be the tied output layer."""

    def __init__(self, source: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.source = source
        self.dtype = dtype
        self.num_embeddings = source.out_features
        self.embedding_dim = source.in_features

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        return self.source.rows(flat, self.dtype).reshape(*ids.shape, self.embedding_dim)
