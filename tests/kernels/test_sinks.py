"""Attention sinks (GPT-OSS: one learned logit per head that joins each softmax's denominator and
carries no value) on every path that serves them: the torch reference against a naive loop over
positions, the native CPU decode kernel (and the prefill-as-decodes split around it) against the
reference, the Triton kernels under the interpreter against the reference, and the
``sonar::attention`` operator. Sinks are drawn large enough to change the result; each test
checks that they do."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import ops, reference
from sonar.kernels.attention_op import attention_op, step_metadata
from sonar.kernels.triton import paged_attention as triton_paged_attention
from sonar.kernels.triton import paged_decode_attention
from tests.kernels.naive_attention import MIXED, naive_attention
from tests.kernels.test_triton_attention import assert_close, make_batch, poisoned_like


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Sinks around the scores' size (some above, some below them), float32 as the model keeps them."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0 + 1.0


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_a_naive_loop(window: int | None) -> None:
    batch = make_batch(*MIXED, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    scale, sinks = 16**-0.5, sinks_for(4)
    got = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window, sinks=sinks)
    torch.testing.assert_close(got.double(), naive_attention(batch, scale, window, sinks=sinks), atol=1e-5, rtol=1e-5)
    plain = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window)
    assert (got - plain).abs().max() > 0.05, "the sinks did not change the result"


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
    decode kernel with the sinks, against the float32 reference on the same values."""
    batch = make_batch(*MIXED, dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    scale, sinks = head_dim**-0.5, sinks_for(num_heads, seed=1)
    assert ops.use_native(batch.query, batch.cache)
    got = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, window, sinks=sinks)
    want = reference.paged_attention(batch.query.float(), batch.cache.float(), batch.meta, scale, window, sinks=sinks)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    plain = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, window)
    assert (got.float() - plain.float()).abs().max() > 0.05


@needs_native
def test_native_split_leaves_long_prefills_to_the_reference_with_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills longer than `PREFILL_AS_DECODES_MAX_LEN` take the reference's prefill path beside
    the native decodes: the sinks apply there too."""
    monkeypatch.setattr(ops, "PREFILL_AS_DECODES_MAX_LEN", 8)
    batch = make_batch(*MIXED, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    scale, sinks = 16**-0.5, sinks_for(4, seed=2)
    assert batch.meta.token_split(8).prefills, "no sequence left to the prefill path"
    got = ops.paged_attention(batch.query, batch.cache, batch.meta, scale, 6, sinks=sinks)
    want = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, 6, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_op_refuses_sinks_of_the_wrong_shape() -> None:
    batch = make_batch([1, 1], [30, 9], dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16)
    m = batch.meta
    no_rows = torch.empty(0, dtype=torch.int64)
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="sinks"):
        torch.ops.sonar_cpu.decode_attention(
            out, batch.query, batch.cache, m.block_tables, m.seq_lens, no_rows, 0.25, -1, 0.0, torch.zeros(3)
        )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_matches_reference(num_splits: int) -> None:
    """With several splits only the first carries the sink; the reduction spreads it to all."""
    batch = make_batch([1, 1, 1], [45, 9, 23], dtype=torch.float32, num_heads=6, num_kv_heads=2, head_dim=24, seed=3)
    m, scale, sinks = batch.meta, 24**-0.5, sinks_for(6, seed=3)
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
        sinks=sinks,
    )
    want = reference.paged_attention(batch.query, batch.cache, m, scale, 13, sinks=sinks)
    assert_close(got, want, torch.float32)
    assert (want - reference.paged_attention(batch.query, batch.cache, m, scale, 13)).abs().max() > 0.05


@pytest.mark.parametrize("window", [None, 6])
def test_triton_prefill_matches_reference(window: int | None) -> None:
    """A mixed batch (decodes, a prefill, a chunk over a cached prefix) through the prefill kernel."""
    batch = make_batch(*MIXED, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, seed=4)
    scale, sinks = 16**-0.5, sinks_for(4, seed=4)
    got = triton_paged_attention(
        batch.query, batch.cache, batch.meta, scale, window, out=poisoned_like(batch.query), sinks=sinks
    )
    want = reference.paged_attention(batch.query, batch.cache, batch.meta, scale, window, sinks=sinks)
    assert_close(got, want, torch.float32)


def test_attention_operator_carries_the_sinks() -> None:
    """``torch.ops.sonar.attention``, what a compiled forward pass calls, takes the sinks and
    applies them; its fake and schema agree (`torch.library.opcheck`)."""
    batch = make_batch(*MIXED, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    meta, n = batch.meta, batch.query.shape[0]
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(n, 2, 16, generator=gen)
    value = torch.randn(n, 2, 16, generator=gen)
    sinks = sinks_for(4, seed=5)
    cache = batch.cache.clone()
    with step_metadata(meta):
        got = torch.ops.sonar.attention(batch.query, key, value, cache, 0.25, None, None, sinks)
        torch.library.opcheck(
            attention_op,
            (batch.query, key, value, batch.cache.clone(), 0.25, None, None, sinks),
            test_utils=("test_schema", "test_faketensor"),
        )
    want_cache = batch.cache.clone()
    reference.write_kv_cache(key, value, want_cache, meta.slot_mapping)
    torch.testing.assert_close(cache, want_cache, equal_nan=True)
    want = reference.paged_attention(batch.query, want_cache, meta, 0.25, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - reference.paged_attention(batch.query, want_cache, meta, 0.25)).abs().max() > 0.05
