"""Attention logit soft-capping (Gemma 2: ``c * tanh(s / c)`` on each scaled score before the
softmax) on every path that serves it: the torch reference against a naive loop over positions,
the native CPU decode kernel (and the prefill-as-decodes split around it) against the reference,
and the Triton kernels under the interpreter against the reference. Scores are made large
(keys scaled up) so that the cap changes the result; each test checks that it does."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import ops, reference
from sonar.kernels.attention_op import attention_op, step_metadata
from sonar.kernels.triton import paged_attention as triton_paged_attention
from sonar.kernels.triton import paged_decode_attention
from tests.kernels.naive_attention import MIXED, naive_attention
from tests.kernels.test_triton_attention import Batch, assert_close, make_batch, poisoned_like

CAP = 5.0


def loud_batch(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, **kw) -> Batch:
    """`make_batch` with queries scaled up: scores of tens, well past the cap."""
    batch = make_batch(query_lens, seq_lens, dtype=dtype, **kw)
    batch.query.mul_(4)
    return batch


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_a_naive_loop(window: int | None) -> None:
    batch = loud_batch(*MIXED, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    scale = 16**-0.5
    got = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window, softcap=CAP)
    torch.testing.assert_close(got.double(), naive_attention(batch, scale, window, softcap=CAP), atol=1e-5, rtol=1e-5)
    uncapped = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window)
    torch.testing.assert_close(uncapped.double(), naive_attention(batch, scale, window), atol=1e-5, rtol=1e-5)
    assert (got - uncapped).abs().max() > 0.05, "the cap did not change the result: scores too small to test it"


needs_native = pytest.mark.usefixtures("native_built")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 2, 64), (3, 1, 128), (6, 2, 48), (2, 2, 24)],  # fixed AVX-512 kernels, the generic, the portable
)
@pytest.mark.parametrize("window", [None, 6])
def test_native_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None
) -> None:
    """`ops.paged_attention` on CPU tensors: every row (prefill tokens too) through the native
    decode kernel with the cap, against the reference in float32 on the same values (the kernel
    accumulates in float32; a bfloat16 reference would round its scores and probabilities)."""
    batch = loud_batch(*MIXED, dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    scale = head_dim**-0.5
    assert ops.use_native(batch.query, batch.cache)
    got = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, window, softcap=CAP)
    want = reference.paged_attention(batch.query.float(), batch.cache.float(), batch.meta, scale, window, softcap=CAP)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    uncapped = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, window)
    assert (got.float() - uncapped.float()).abs().max() > 0.05


@needs_native
def test_native_split_leaves_long_prefills_to_the_capped_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills longer than `PREFILL_AS_DECODES_MAX_LEN` take the reference's prefill path beside
    the native decodes: the cap applies there too."""
    monkeypatch.setattr(ops, "PREFILL_AS_DECODES_MAX_LEN", 8)
    batch = loud_batch(*MIXED, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    scale = 16**-0.5
    assert batch.meta.token_split(8).prefills, "no sequence left to the prefill path"
    got = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, 6, softcap=CAP)
    want = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, 6, softcap=CAP)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_op_default_is_uncapped() -> None:
    """The operator's ``softcap`` defaults to 0 (off): callers that pass no cap are unchanged."""
    batch = loud_batch([1, 1], [30, 9], torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    m, scale = batch.meta, 0.25
    out = torch.empty_like(batch.query)
    no_rows = torch.empty(0, dtype=torch.int64)
    torch.ops.sonar_cpu.decode_attention(out, batch.query, batch.cache, m.block_tables, m.seq_lens, no_rows, scale, -1)
    want = reference.paged_attention(batch.query, batch.cache, m, scale)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_matches_reference(num_splits: int) -> None:
    batch = loud_batch([1, 1, 1], [45, 9, 23], torch.float32, num_heads=6, num_kv_heads=2, head_dim=24, seed=3)
    m, scale = batch.meta, 24**-0.5
    got = paged_decode_attention(
        batch.query,
        batch.cache,
        m.block_tables,
        m.seq_lens,
        scale,
        m.max_seq_len,
        13,
        num_splits=num_splits,
        out=poisoned_like(batch.query),
        softcap=CAP,
    )
    want = reference.paged_attention(batch.query, batch.cache, m, scale, 13, softcap=CAP)
    assert_close(got, want, torch.float32)
    assert (want - reference.paged_attention(batch.query, batch.cache, m, scale, 13)).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, 6])
def test_triton_prefill_matches_reference(window: int | None) -> None:
    """A mixed batch (decodes, a prefill, a chunk over a cached prefix) through the prefill kernel."""
    batch = loud_batch(*MIXED, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, seed=4)
    scale = 16**-0.5
    got = triton_paged_attention(
        batch.query, batch.cache, batch.meta, scale, window, out=poisoned_like(batch.query), softcap=CAP
    )
    want = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window, softcap=CAP)
    assert_close(got, want, torch.float32)


def test_triton_fp8_cache_caps_the_dequantized_scores() -> None:
    """With a float8 cache the key scale folds into the scores before the cap."""
    batch = loud_batch(
        [1, 5], [20, 11], torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, kv_dtype=torch.float8_e4m3fn
    )
    scale = 16**-0.5
    got = triton_paged_attention(
        batch.query, batch.cache, batch.meta, scale, None, batch.k_scale, batch.v_scale, softcap=CAP
    )
    want = reference.paged_attention(
        batch.query, batch.cache, batch.meta, scale, None, batch.k_scale, batch.v_scale, softcap=CAP
    )
    assert_close(got, want, torch.float32)


def test_attention_operator_carries_the_cap() -> None:
    """``torch.ops.sonar.attention``, what a compiled forward pass calls (and a CUDA graph
    captures), takes the cap and applies it; its fake and schema agree (`torch.library.opcheck`)."""
    batch = loud_batch(*MIXED, torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    meta, n = batch.meta, batch.query.shape[0]
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(n, 2, 16, generator=gen)
    value = torch.randn(n, 2, 16, generator=gen)
    cache = batch.cache.clone()
    with step_metadata(meta):
        got = torch.ops.sonar.attention(batch.query, key, value, cache, 0.25, 6, CAP)
        torch.library.opcheck(
            attention_op,
            (batch.query, key, value, batch.cache.clone(), 0.25, 6, CAP),
            test_utils=("test_schema", "test_faketensor"),
        )
    want_cache = batch.cache.clone()
    reference.write_kv_cache(key, value, want_cache, meta.slot_mapping)
    torch.testing.assert_close(cache, want_cache, equal_nan=True)
    want = reference.paged_attention(batch.query, want_cache, meta, 0.25, 6, softcap=CAP)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - reference.paged_attention(batch.query, want_cache, meta, 0.25, 6)).abs().max() > 0.05
