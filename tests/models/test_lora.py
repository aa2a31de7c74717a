"""`sonar.models.lora.LoRALinear`: B packed for the native kernel follows every write of ``b``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sonar.kernels import lora as lora_kernels
from sonar.kernels import native, reference
from sonar.models.lora import LoRAContext, LoRALinear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_b_follows_writes_of_b(dtype: torch.dtype) -> None:
    """A slot written in place (as `AdapterSlots` writes one, under inference mode) is packed
    again before the next forward pass reads it: the output is the reference's for the new B."""
    assert native.available()
    gen = torch.Generator().manual_seed(0)
    context = LoRAContext(torch.device("cpu"))
    base = nn.Linear(32, 48, bias=False).to(dtype)
    with torch.inference_mode():
        layer = LoRALinear(base, 32, (32, 16), max_loras=2, max_rank=8, dtype=dtype, context=context)
    assert layer.b_packed is not None and lora_kernels.packs_b(layer.b)
    x = torch.randn(3, 32, generator=gen).to(dtype)
    for value in (0.5, -0.25):
        with torch.inference_mode():
            layer.a[1].copy_(torch.randn(layer.a[1].shape, generator=gen))
            layer.b[1].fill_(value)
            with context.step([1, -1, 1]):
                got = layer(x)
        want = base(x)
        reference.lora_add(want, x, layer.a, layer.b, torch.tensor([1, -1, 1]), (32, 16))
        torch.testing.assert_close(got, want)
        assert torch.equal(layer.b_packed, lora_kernels.pack_b(layer.b, (32, 16)))


def test_no_packed_b_where_the_kernel_reads_b() -> None:
    context = LoRAContext(torch.device("cpu"))
    layer = LoRALinear(nn.Linear(8, 8), 8, (8,), 1, 4, torch.float16, context)
    assert layer.b_packed is None and layer.packed_b() is None
