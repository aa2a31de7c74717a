"""The KV-cache write kernel against the torch reference, bit for bit, under the interpreter."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import reference
from sonar.kernels.triton import write_kv_cache

NUM_BLOCKS, BLOCK_SIZE = 12, 4


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal as bytes: NaN poison left where nothing was written must match, too."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


def make_kv(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Key and value as strided views into one fused ``[tokens, (q + k + v) heads, head_dim]``
    tensor, the way a QKV projection hands them over."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen) * 4
    fused[0, num_kv_heads, 0] = 3000.0  # past e4m3's range for any scale below ~6.7
    fused[1, num_kv_heads, :4] = torch.tensor([1e-4, -2e-3, 5e-6, -0.0])  # e4m3 subnormals and -0
    fused = fused.to(dtype)
    return fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]


def poisoned_cache(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim), float("nan")).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 16), (3, 24)])
def test_write_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    key, value = make_kv(17, num_kv_heads, head_dim, dtype, seed=1)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(2))[:17]
    slots[5] = -1  # a padding token: written nowhere
    got, want = poisoned_cache(num_kv_heads, head_dim, dtype), poisoned_cache(num_kv_heads, head_dim, dtype)
    write_kv_cache(key, value, got, slots)
    reference.write_kv_cache(key, value, want, slots)
    assert_same_bits(got, want)
    assert torch.isnan(got.float()).sum() == got.numel() - 2 * 16 * num_kv_heads * head_dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_write_quantizes_like_reference(dtype: torch.dtype, per_head: bool) -> None:
    num_kv_heads, head_dim = 3, 16
    key, value = make_kv(13, num_kv_heads, head_dim, dtype, seed=3)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(4))[:13]
    # scales from a calibration that saw smaller values, so some keys saturate
    k_scale, v_scale = reference.kv_scales(key * 0.5, value, per_head=per_head)
    assert k_scale.shape == ((num_kv_heads,) if per_head else (1,))
    got = poisoned_cache(num_kv_heads, head_dim, torch.float8_e4m3fn)
    want = got.clone()
    write_kv_cache(key, value, got, slots, k_scale, v_scale)
    reference.write_kv_cache(key, value, want, slots, k_scale, v_scale)
    assert_same_bits(got, want)
    # and the quantization is a good one: the stored values dequantize to within e4m3's half step
    flat = got.view(2, -1, num_kv_heads, head_dim)
    back_k = reference.dequantize_fp8(flat[0, slots], k_scale, torch.float32)
    scale = k_scale.view(-1, 1) if per_head else k_scale
    clipped = torch.minimum(key.float().abs(), 448 * scale) * key.float().sign()
    assert torch.allclose(back_k, clipped, rtol=2**-4, atol=float(scale.max()) * 2**-10)
