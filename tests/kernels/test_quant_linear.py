"""`QuantLinear` and `QuantEmbedding` over the reference backend: packed once (int4 two values per
byte), the formula on every call, and one opaque operator under ``torch.compile``."""

from __future__ import annotations

import torch

from sonar.kernels.quant import QuantizedWeight, dequantize, reference_linear
from sonar.kernels.quant_linear import QuantEmbedding, QuantLinear, ReferenceBackend, pack_nibbles, unpack_nibbles


def _weight(n: int = 48, k: int = 64) -> QuantizedWeight:
    g = torch.Generator().manual_seed(0)
    return QuantizedWeight(
        "int4",
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        torch.rand(n, k // 32, generator=g) / 8,
        -torch.rand(n, k // 32, generator=g),
        32,
    )


def test_nibbles_round_trip() -> None:
    values = _weight().values
    packed = pack_nibbles(values)
    assert packed.shape == (48, 32)
    assert torch.equal(unpack_nibbles(packed), values)


def test_layer_is_the_reference_and_keeps_only_packed_bytes() -> None:
    qw = _weight()
    bias = torch.randn(48)
    layer = QuantLinear(qw, bias, ReferenceBackend())
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(layer(x), reference_linear(x.reshape(6, 64), qw, bias).reshape(2, 3, 48))
    assert layer.nbytes == qw.nbytes == 48 * 32 + 2 * 48 * 2 * 4
    embedding = QuantEmbedding(layer, torch.bfloat16)
    ids = torch.tensor([[3, 47], [0, 3]])
    torch.testing.assert_close(embedding(ids), dequantize(qw, torch.bfloat16)[ids], rtol=0, atol=0)


def test_compiled_layer_is_one_opaque_call() -> None:
    layer = QuantLinear(_weight(), None, ReferenceBackend())
    x = torch.randn(5, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
