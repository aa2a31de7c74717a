"""RMSNorm (plain and with the fused residual add) and SiLU-and-mul against their torch references
under the interpreter; the references themselves against the model code whose semantics they copy."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import reference
from sonar.kernels.triton import rms_norm, silu_and_mul
from sonar.models.decoder import RMSNorm

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


def test_silu_and_mul_reference_is_the_models() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    gate, up = x.split(32, dim=-1)
    assert torch.equal(reference.silu_and_mul(x), torch.nn.functional.silu(gate) * up)
