"""RMSNorm (plain and with the fused residual add), SiLU-and-mul and rotary embeddings (neox and
gpt-j layouts, Llama-3 scaled frequencies) against their torch references under the interpreter;
the references themselves against the model code whose semantics they copy."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import reference
from sonar.kernels.triton import rms_norm, rotary_embedding, silu_and_mul
from sonar.models.decoder import RMSNorm
from sonar.models.rotary import RotaryEmbedding, apply_rotary

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any(), "unwritten (NaN) elements"
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- RMSNorm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 96), (5, 3, 24)])  # hidden states; per-head q/k norm
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, weight, 1e-6, out=out)
    assert got is out
    close(got, reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 80, generator=gen).to(dtype)
    residual = torch.randn(6, 80, generator=gen).to(dtype)
    weight = torch.randn(80, generator=gen).to(dtype)
    want, want_residual = reference.rms_norm(x, weight, 1e-5, residual)
    got, got_residual = rms_norm(x, weight, 1e-5, residual.clone(), out=torch.full_like(x, float("nan")))
    close(got, want, dtype)
    close(got_residual, want_residual, dtype)


def test_rms_norm_reference_is_the_models() -> None:
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(reference.rms_norm(x, norm.weight.detach(), 1e-6), norm(x))


# --- SiLU-and-mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 1500])  # one tile; two tiles of 1024 with a ragged end
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 2 * d, generator=gen) * 4).to(dtype)
    out = torch.full((3, d), float("nan"), dtype=dtype)
    got = silu_and_mul(x, out=out)
    close(got, reference.silu_and_mul(x), dtype)


# --- rotary embeddings ------------------------------------------------------------------------------


def qk(num_tokens: int, head_dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query (4 heads) and key (2 heads) as strided views into one fused QKV output."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 8, head_dim, generator=gen).to(dtype)
    return fused[:, :4], fused[:, 4:6]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # whole head; partial (the rest passes through)
def test_rotary(dtype: torch.dtype, is_neox: bool, rot_dim: int) -> None:
    head_dim = 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    cache = reference.build_cos_sin_cache(inv_freq, 64)
    positions = torch.tensor([0, 5, 63, 17, 17, 2])
    q, k = qk(6, head_dim, dtype, seed=4)
    # the reference in float32 (the kernel's own precision), rounded once
    want_q, want_k = (t.to(dtype) for t in reference.rotary_embedding(positions, q.float(), k.float(), cache, is_neox))
    got_q, got_k = rotary_embedding(positions, q, k, cache, is_neox)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=["llama3", "yarn"],
)
def test_rotary_scaled_cache_matches_the_model(dtype: torch.dtype, params: dict) -> None:
    """A cache built from the model's scaled frequencies (and YaRN's attention factor) gives the
    model's own ``apply_rotary`` result: the reference bit for bit, the kernel within tolerance."""
    head_dim = 32
    rope = RotaryEmbedding(params, head_dim, max_position_embeddings=512)
    cache = reference.build_cos_sin_cache(rope.inv_freq, 512, rope.scale)
    positions = torch.tensor([3, 100, 511, 0, 250])
    q, k = qk(5, head_dim, dtype, seed=5)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(positions, q, k, cache, is_neox=True)
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    got_q, got_k = rotary_embedding(positions, q.clone(), k.clone(), cache, is_neox=True)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


def test_silu_and_mul_reference_is_the_models() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    gate, up = x.split(32, dim=-1)
    assert torch.equal(reference.silu_and_mul(x), torch.nn.functional.silu(gate) * up)
