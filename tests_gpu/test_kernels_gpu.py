"""The Triton kernels on the GPU at real model shapes against the torch references (float32 on the
reference side). Outputs and unused cache slots are NaN before each run."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import ops, reference
from sonar.kernels.triton import (
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    silu_and_mul,
    write_kv_cache,
)
from tests_gpu.cases import BLOCK_SIZE, LLAMA_8B, QWEN3_06B, SMOLLM2_135M, AttnShape, paged_batch, reference_attention

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} NaN (unwritten?) elements"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# --- attention --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN3_06B, SMOLLM2_135M], ids=lambda s: s.name)
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_batch64_up_to_4k(shape: AttnShape, num_splits: int | None) -> None:
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    seq_lens[0], seq_lens[1] = 4096, 1
    b = paged_batch(shape, [1] * 64, seq_lens)
    got = paged_decode_attention(
        b.query,
        b.cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.scale,
        b.meta.max_seq_len,
        num_splits=num_splits,
        out=nan_like(b.query),
    )
    close(got, reference_attention(b), TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_other_dtypes(dtype: torch.dtype) -> None:
    b = paged_batch(LLAMA_8B, [1] * 8, [3000, 17, 1, 512, 4096, 100, 2048, 77], dtype=dtype)
    got = paged_decode_attention(
        b.query, b.cache, b.meta.block_tables, b.meta.seq_lens, b.scale, b.meta.max_seq_len, out=nan_like(b.query)
    )
    close(got, reference_attention(b), TOL[dtype])


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_fp8_cache(per_head: bool) -> None:
    seq_lens = torch.randint(1, 4097, (32,)).tolist()
    b = paged_batch(LLAMA_8B, [1] * 32, seq_lens, kv_dtype=torch.float8_e4m3fn, per_head_scale=per_head)
    got = paged_decode_attention(
        b.query,
        b.cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.scale,
        b.meta.max_seq_len,
        k_scale=b.k_scale,
        v_scale=b.v_scale,
        out=nan_like(b.query),
    )
    close(got, reference_attention(b), TOL[torch.bfloat16])


def test_decode_sliding_window() -> None:
    b = paged_batch(QWEN3_06B, [1] * 16, torch.randint(1, 4097, (16,)).tolist())
    got = paged_decode_attention(
        b.query,
        b.cache,
        b.meta.block_tables,
        b.meta.seq_lens,
        b.scale,
        b.meta.max_seq_len,
        1000,
        num_splits=4,
        out=nan_like(b.query),
    )
    close(got, reference_attention(b, 1000), TOL[torch.bfloat16])


@pytest.mark.parametrize("shape", [LLAMA_8B, SMOLLM2_135M], ids=lambda s: s.name)
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_prefill_chunked_mixed_batch(shape: AttnShape, kv_dtype: torch.dtype) -> None:
    """A fresh 2048-token prompt, a 512-token chunk over a 1500-token prefix, decodes, and a chunk
    ending mid-block."""
    query_lens = [2048, 512, 1, 1, 77]
    seq_lens = [2048, 2012, 4000, 9, 301]
    b = paged_batch(shape, query_lens, seq_lens, kv_dtype=kv_dtype)
    got = paged_prefill_attention(
        b.query,
        b.cache,
        b.meta.query_start_loc,
        b.meta.seq_lens,
        b.meta.block_tables,
        b.scale,
        b.meta.max_query_len,
        k_scale=b.k_scale,
        v_scale=b.v_scale,
        out=nan_like(b.query),
    )
    close(got, reference_attention(b), TOL[torch.bfloat16])


def test_prefill_sliding_window() -> None:
    b = paged_batch(QWEN3_06B, [1000, 300], [1000, 2500])
    got = paged_prefill_attention(
        b.query,
        b.cache,
        b.meta.query_start_loc,
        b.meta.seq_lens,
        b.meta.block_tables,
        b.scale,
        b.meta.max_query_len,
        256,
        out=nan_like(b.query),
    )
    close(got, reference_attention(b, 256), TOL[torch.bfloat16])


def test_ops_dispatch_matches_reference_on_cuda() -> None:
    """``sonar.kernels.ops`` picks the kernels on CUDA; layer-by-layer steps match the reference."""
    assert ops.use_triton(torch.zeros(1, device="cuda"))
    b = paged_batch(LLAMA_8B, [300, 1, 1], [300, 1200, 40])
    got = ops.paged_attention(b.query, b.cache, b.meta, b.scale)
    close(got, reference_attention(b), TOL[torch.bfloat16])
    d = paged_batch(LLAMA_8B, [1, 1, 1], [300, 1200, 40])
    close(paged_attention(d.query, d.cache, d.meta, d.scale), reference_attention(d), TOL[torch.bfloat16])


# --- KV cache write ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("per_head", [False, True])
def test_kv_cache_write(kv_dtype: torch.dtype, per_head: bool) -> None:
    n, heads, dim, blocks = 8192, 8, 128, 1024
    fused = torch.randn(n, 3 * heads, dim, device="cuda", dtype=torch.bfloat16)
    key, value = fused[:, :heads], fused[:, heads : 2 * heads]
    slots = torch.randperm(blocks * BLOCK_SIZE, device="cuda")[:n]
    slots[::97] = -1
    got = torch.full((2, blocks, BLOCK_SIZE, heads, dim), float("nan"), device="cuda").to(kv_dtype)
    want = got.clone()
    k_scale = v_scale = None
    if kv_dtype == torch.float8_e4m3fn:
        k_scale, v_scale = reference.kv_scales(key * 0.7, value, per_head=per_head)
    write_kv_cache(key, value, got, slots, k_scale, v_scale)
    reference.write_kv_cache(key, value, want, slots, k_scale, v_scale)
    if kv_dtype == torch.float8_e4m3fn:
        # GPU float division may differ from torch's in the last bit: allow one e4m3 step
        g, w = got.float(), want.float()
        same_nan = torch.isnan(g) == torch.isnan(w)
        assert same_nan.all()
        g, w = g.nan_to_num(), w.nan_to_num()
        assert ((g - w).abs() <= w.abs() * 2**-3 + 2**-9).all()
        assert (g == w).float().mean() > 0.999
    else:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# --- norms, activations ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype) -> None:
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=dtype)
    close(rms_norm(x, weight, 1e-6, out=nan_like(x)), reference.rms_norm(x, weight, 1e-6), TOL[dtype])
    want, want_res = reference.rms_norm(x, weight, 1e-6, residual)
    got, got_res = rms_norm(x, weight, 1e-6, residual.clone(), out=nan_like(x))
    close(got, want, TOL[dtype])
    close(got_res, want_res, TOL[dtype])
    q = torch.randn(4096, 32, 128, device="cuda", dtype=dtype)  # per-head q norm (Qwen3)
    w = torch.randn(128, device="cuda", dtype=dtype)
    close(rms_norm(q, w, 1e-6, out=nan_like(q)), reference.rms_norm(q, w, 1e-6), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=dtype) * 3
    out = torch.full((4096, 14336), float("nan"), device="cuda", dtype=dtype)
    close(silu_and_mul(x, out=out), reference.silu_and_mul(x.float()), TOL[dtype])


# --- block copy ----------------------------------------------------------------------------------------------


def test_copy_blocks_on_gpu_and_through_pinned_memory() -> None:
    gpu = torch.randn(2, 4096, BLOCK_SIZE, 8, 128, device="cuda", dtype=torch.bfloat16)
    other = torch.full((2, 1024, BLOCK_SIZE, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    src_ids = torch.randperm(4096, device="cuda")[:512]
    dst_ids = torch.randperm(1024, device="cuda")[:512]
    copy_blocks(gpu, other, src_ids, dst_ids)
    assert torch.equal(other[:, dst_ids], gpu[:, src_ids])
    # GPU -> pinned CPU staging -> GPU, through ops (torch path across devices)
    staging = torch.empty((2, 512, BLOCK_SIZE, 8, 128), dtype=torch.bfloat16, pin_memory=True)
    ops.copy_blocks(gpu, staging, src_ids, torch.arange(512))
    torch.cuda.synchronize()
    back = torch.full_like(gpu, float("nan"))
    ops.copy_blocks(staging, back, torch.arange(512), src_ids)
    torch.cuda.synchronize()
    assert torch.equal(back[:, src_ids], gpu[:, src_ids])
