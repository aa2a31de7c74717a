"""The native CPU kernels (``sonar/kernels/csrc/cpu_ops.cpp``) against their torch references: the
build and its cache, decode attention over the paged cache (mixed batches, GQA, sliding windows,
poisoned unused slots, both work splits, the AVX-512 and portable paths), prefill attention
(chunks over cached prefixes, several spans of keys, sinks, block sizes), RMSNorm, SiLU-and-mul,
rotary, the bf16 linear kernel, and the typed errors on bad input. (``lora_add`` has its own
module, ``test_lora.py``; the portable build's check here covers it too.)"""

from __future__ import annotations

import fcntl
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sonar.kernels import native, ops, reference
from sonar.kernels.attention import AttentionMetadata, allocate_kv_caches, write_kv_cache
from sonar.kernels.linear import PackedLinear, can_pack, can_pack_native, pack_native, prepack_linears
from sonar.models import rotary
from tests.kernels.blocks import scattered_block_tables
from tests.kernels.conftest import PORTABLE_FLAGS

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_a_second_builder_waits_for_the_first_and_loads_its_library(tmp_path: Path) -> None:
    """Two processes building one key on a cold cache compile once: the second waits on the lock
    and takes the library the first wrote (here the first is this test, holding the lock while it
    puts a built library in place)."""
    compiler = native._compiler()
    assert compiler is not None
    directory = tmp_path / "native" / native.build_key(compiler)
    directory.mkdir(parents=True)
    got: list[Path] = []
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: got.append(native.build(tmp_path)))
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive() and not got  # waiting on the lock, not compiling beside it
        shutil.copy(native.build(), directory / native.LIBRARY_NAME)
        stamp = (directory / native.LIBRARY_NAME).stat().st_mtime_ns
    waiter.join(timeout=30)
    assert got == [directory / native.LIBRARY_NAME]
    assert got[0].stat().st_mtime_ns == stamp and not list(directory.glob(".build-*"))


def test_another_checkout_of_the_source_shares_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key follows the source's bytes, not its path: a second clone loads the first's library."""
    compiler = native._compiler()
    assert compiler is not None
    key = native.build_key(compiler)
    copy = tmp_path / "clone" / native.SOURCE.name
    copy.parent.mkdir()
    copy.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", copy)
    assert native.build_key(compiler) == key
    copy.write_bytes(native.SOURCE.read_bytes() + b"\n// changed\n")
    assert native.build_key(compiler) != key


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert ops.use_native(x)
    monkeypatch.setenv("SONAR_NATIVE_KERNELS", "0")
    assert not ops.use_native(x)
    assert not can_pack_native(torch.randn(16, 8, dtype=torch.bfloat16))
    holder = nn.Sequential(nn.Linear(8, 16, dtype=torch.bfloat16))
    prepack_linears(holder)  # oneDNN's packing where this CPU has it, else the plain layer
    assert not getattr(holder[0], "native_layout", False)


def test_other_dtypes_and_devices_take_the_reference() -> None:
    assert not ops.use_native(torch.randn(2, 8).to(torch.float8_e4m3fn))
    assert not ops.use_native(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(8))  # mixed dtypes
    assert not ops.use_native(torch.randn(2, 8, dtype=torch.float64))


# --- decode attention ----------------------------------------------------------------------------


def _poisoned_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, kv_heads, head_dim, dtype)
    cache.fill_(float("nan"))  # every slot no sequence wrote stays NaN: reading one would show
    return cache


def _batch(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, seed: int
) -> AttentionMetadata:
    tables = scattered_block_tables(seq_lens, block_size, num_blocks, torch.Generator().manual_seed(seed))
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size)


def _fill_context(cache: torch.Tensor, meta: AttentionMetadata, seq_lens: list[int], seed: int) -> None:
    """Write keys and values for every position of every sequence (the prompt and the new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    _, _, block_size, kv_heads, head_dim = cache.shape
    full = AttentionMetadata.build(seq_lens, seq_lens, meta.block_tables.tolist(), block_size)
    n = full.num_tokens
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(cache.dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(cache.dtype)
    write_kv_cache(k, v, cache, full.slot_mapping)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    # 64, 128: the fixed-group kernels; 32, 80: the generic AVX-512 one; 40: the portable one
    [(9, 3, 64), (4, 4, 128), (8, 2, 32), (6, 2, 80), (6, 3, 40)],
)
@pytest.mark.parametrize("window", [None, 7])
# prefills up to this long go through the decode kernel a token at a time, longer ones through SDPA:
# all of them, those of 12 tokens but not 40, none
@pytest.mark.parametrize("max_len", [ops.PREFILL_AS_DECODES_MAX_LEN, 20, 0])
def test_decode_attention_matches_the_reference(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
    max_len: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ops, "PREFILL_AS_DECODES_MAX_LEN", max_len)
    monkeypatch.setattr(ops, "AMX_PREFILL_AS_DECODES_MAX_LEN", max_len)  # bfloat16 on a CPU with AMX
    block_size, num_blocks = 16, 96
    # one prefill chunk over a cached prefix, a fresh prompt and decodes of several lengths
    query_lens = [1, 5, 1, 1, 12, 1, 1]
    seq_lens = [1, 40, 17, 16, 12, 130, 63]
    meta = _batch(query_lens, seq_lens, block_size, num_blocks, seed=head_dim)
    cache = _poisoned_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    _fill_context(cache, meta, seq_lens, seed=heads)
    gen = torch.Generator().manual_seed(1)
    qk = torch.randn(meta.num_tokens, heads + kv_heads, head_dim, generator=gen).to(dtype)
    query = qk[:, :heads]  # a strided view, as the decoder hands it over
    got = ops.paged_attention(query, cache, meta, head_dim**-0.5, window)
    want = reference.paged_attention(query, cache, meta, head_dim**-0.5, window)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_token_split_makes_each_prefill_token_a_decode_of_its_prefix() -> None:
    # sequences: a decode at position 39, a 5-token chunk after 35 cached, a fresh 3-token prompt
    meta = _batch([1, 5, 3], [40, 40, 3], 16, 32, seed=0)
    split = meta.token_split(4096)
    assert split.rows.numel() == 0 and split.prefills == []
    assert split.seq_lens.tolist() == [40, 36, 37, 38, 39, 40, 1, 2, 3]
    tables = meta.block_tables.tolist()
    assert split.block_tables.tolist() == [tables[0]] + [tables[1]] * 5 + [tables[2]] * 3
    # the 40-long chunk left to the prefill kernel: the other rows keep their query rows
    short = meta.token_split(39)
    assert short.prefills == [1]
    assert short.rows.tolist() == [0, 6, 7, 8] and short.seq_lens.tolist() == [40, 1, 2, 3]
    assert short.block_tables.tolist() == [tables[0]] + [tables[2]] * 3


@pytest.mark.parametrize("num_seqs", [1, 2, 9])  # below and above two sequences per thread
def test_decode_only_batches_either_split(num_seqs: int) -> None:
    block_size, num_blocks = 16, 128
    seq_lens = [3 + 29 * i for i in range(num_seqs)]
    meta = _batch([1] * num_seqs, seq_lens, block_size, num_blocks, seed=num_seqs)
    cache = _poisoned_cache(num_blocks, block_size, 3, 64, torch.bfloat16)
    _fill_context(cache, meta, seq_lens, seed=num_seqs)
    query = torch.randn(num_seqs, 9, 64).to(torch.bfloat16)
    got = ops.paged_attention(query, cache, meta, 0.125)
    want = reference.paged_attention(query, cache, meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seq_lens", [[600], [1000, 300], [700, 5, 400]])  # fewer sequences than 2 per thread
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_attention_splits_long_sequences_into_shares(
    dtype: torch.dtype, seq_lens: list[int], window: int | None, sinks: bool
) -> None:
    """A few long decodes: every head over a share of the blocks per unit, the shares merged
    (a share past a short sequence's end, or before its window, sees nothing); the sinks count once."""
    num_seqs = len(seq_lens)
    meta = _batch([1] * num_seqs, seq_lens, 16, 160, seed=len(seq_lens))
    cache = _poisoned_cache(160, 16, 3, 64, dtype)
    _fill_context(cache, meta, seq_lens, seed=7)
    query = torch.randn(num_seqs, 9, 64).to(dtype)
    logits = torch.randn(9) * 2 + 1 if sinks else None
    got = ops.paged_attention(query, cache, meta, 0.125, window, sinks=logits)
    want = reference.paged_attention(query.float(), cache.float(), meta, 0.125, window, sinks=logits)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_decode_attention_rejects_bad_input() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64)
    tables, lens, rows = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int64),
    )
    query = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.sonar_cpu.decode_attention(
            torch.empty_like(query), query.double(), cache, tables, lens, rows, 1.0, -1
        )
    with pytest.raises(RuntimeError, match="int32 block_tables"):
        torch.ops.sonar_cpu.decode_attention(torch.empty_like(query), query, cache, tables.long(), lens, rows, 1.0, -1)
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        bad = torch.randn(1, 3, 64)
        torch.ops.sonar_cpu.decode_attention(torch.empty_like(bad), bad, cache, tables, lens, rows, 1.0, -1)


# --- prefill attention --------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32)])
@pytest.mark.parametrize("window", [None, 7, 300])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("sinks", [False, True])
def test_prefill_kernel_matches_the_reference(
    heads: int, kv_heads: int, head_dim: int, window: int | None, block_size: int, sinks: bool
) -> None:
    """bfloat16 chunks of 16 query tokens and more go to `sonar_cpu::prefill_attention` (on a CPU
    with AVX512-BF16; elsewhere to the decode kernel), the others to the decode kernel, in one step;
    against the float32 reference on the same values."""
    # decodes, a fresh prompt, a chunk over 183 cached tokens, exactly 16 fresh, a 3-token chunk
    # (the decode kernel's), 100 over 500 cached (two spans of keys) and 33 fresh (a partial tile)
    query_lens = [1, 40, 1, 17, 16, 3, 100, 33]
    seq_lens = [30, 40, 9, 200, 16, 50, 600, 33]
    meta = _batch(query_lens, seq_lens, block_size, 96 * 16 // block_size, seed=head_dim)
    cache = _poisoned_cache(96 * 16 // block_size, block_size, kv_heads, head_dim, torch.bfloat16)
    _fill_context(cache, meta, seq_lens, seed=heads)
    gen = torch.Generator().manual_seed(2)
    qk = torch.randn(meta.num_tokens, heads + kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    query = qk[:, :heads]  # a strided view, as the decoder hands it over
    logits = torch.randn(heads, generator=gen) * 2 + 1 if sinks else None
    split = meta.token_split(ops.PREFILL_AS_DECODES_MAX_LEN, ops.PREFILL_KERNEL_MIN_QUERY)
    assert split.kernel_prefills == [1, 3, 4, 6, 7] and split.prefills == []
    got = ops.paged_attention(query, cache, meta, head_dim**-0.5, window, sinks=logits)
    want = reference.paged_attention(query.float(), cache.float(), meta, head_dim**-0.5, window, sinks=logits)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_kernel_spreads_a_long_prompt_over_the_threads() -> None:
    """One 2000-token prompt: 16-row tiles of every head from a shared counter, longest first."""
    meta = _batch([2000], [2000], 16, 130, seed=5)
    cache = _poisoned_cache(130, 16, 3, 64, torch.bfloat16)
    _fill_context(cache, meta, [2000], seed=5)
    query = torch.randn(2000, 9, 64).to(torch.bfloat16)
    got = ops.paged_attention(query, cache, meta, 0.125)
    want = reference.paged_attention(query.float(), cache.float(), meta, 0.125)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_kernel_rejects_bad_input() -> None:
    meta = _batch([20], [20], 16, 4, seed=0)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    query = torch.randn(20, 4, 64).to(torch.bfloat16)
    seqs = torch.zeros(1, dtype=torch.int64)

    def call(q: torch.Tensor = query, c: torch.Tensor = cache, which: torch.Tensor = seqs) -> None:
        torch.ops.sonar_cpu.prefill_attention(
            torch.empty_like(q), q, c, meta.block_tables, meta.seq_lens, meta.query_start_loc, which, 0.125, -1
        )

    if not torch.ops.sonar_cpu.has_prefill_attention():  # a CPU without AVX512-BF16: a clear refusal
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            call()
        return
    with pytest.raises(RuntimeError, match="are bfloat16"):
        call(q=query.float(), c=cache.float())
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        call(q=torch.randn(20, 4, 80).to(torch.bfloat16), c=torch.zeros(2, 4, 16, 2, 80, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="seqs out of range"):
        call(which=torch.ones(1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        call(q=torch.randn(20, 3, 64).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_write_matches_the_reference_and_skips_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 9 + 2 * 3, 64, generator=gen).to(dtype)
    key, value = qkv[:, 9:12], qkv[:, 12:]  # strided views, as the decoder's
    slots = torch.tensor([5, 17, -1, 40, 2, -1])
    ours = _poisoned_cache(4, 16, 3, 64, dtype)
    theirs = ours.clone()
    ops.write_kv_cache(key, value, ours, slots)
    reference.write_kv_cache(key, value, theirs, slots)
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    assert ours.view(2, -1, 3, 64)[:, 5].isfinite().all() and ours.view(2, -1, 3, 64)[:, 6].isnan().all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.sonar_cpu.write_kv_cache(key, value, ours, torch.tensor([0, 1, 2, 3, 4, 64]))


# --- element-wise kernels ------------------------------------------------------------------------


def _close_and_mostly_equal(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within the dtype's rounding; in half precision also bit-identical almost everywhere (only a
    sum's order or a last-ulp exp can differ before the rounding; in float32 they show)."""
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if dtype != torch.float32:
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [576, 100])  # 100: a partial vector at the end of each row
def test_rms_norm(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(17, width, generator=gen) * 3).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    _close_and_mostly_equal(ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_with_the_residual_add(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width + 1)
    x, residual = ((torch.randn(2, 5, width, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = torch.randn(width, generator=gen).to(dtype)
    normed, summed = ops.rms_norm(x, weight, 1e-6, residual)
    want_normed, want_summed = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, want_summed)  # the add rounds once, as the reference's
    _close_and_mostly_equal(normed, want_normed, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(9, 2 * width, generator=gen) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp's range ends
    _close_and_mostly_equal(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)


@pytest.mark.parametrize("n", [1, 63, 64, 1000, 49152])
def test_row_max_is_torch_max(n: int) -> None:
    """Each row's largest value and its first index, as ``torch.max(x, dim=-1)``: ties, infinities
    and NaN (which counts as the largest) included."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1] = torch.randint(0, 3, (n,), generator=gen).float()  # ties: the first of them wins
    x[2] = float("-inf")  # nothing to pick: -inf at index 0
    x[3, n // 2 :] = float("inf")
    x[4, n - 1] = float("nan")
    x[5, n // 3] = float("nan")
    x[5, n - 1] = float("nan")
    x[6] = float("nan")
    x[7, -1] = 1e30  # the last element
    best, index = ops.row_max(x)
    want, want_index = x.max(dim=-1)
    torch.testing.assert_close(best, want, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(index, want_index)
    assert best.dtype == torch.float32 and index.dtype == torch.int64


def test_row_max_leaves_other_tensors_to_torch() -> None:
    x = torch.randn(3, 40).to(torch.bfloat16)
    for t in (x, x.float().t().contiguous().t(), x.float()[:, :0]):  # bfloat16, strided, no columns
        if t.shape[1] == 0:
            with pytest.raises((IndexError, RuntimeError)):
                ops.row_max(t)
            continue
        best, index = ops.row_max(t)
        want, want_index = t.max(dim=-1)
        assert torch.equal(best, want) and torch.equal(index, want_index)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_rotary_is_bit_identical(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    qk = torch.randn(11, 12, head_dim, generator=gen).to(dtype)
    rope = rotary.RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, head_dim, 4096)
    cos, sin = rope.cos_sin(torch.arange(100, 111), dtype)
    x = qk[:, :9]  # strided, as the decoder's query view
    assert torch.equal(ops.apply_rotary(x, cos, sin), reference.apply_rotary(x, cos, sin))


# --- the bf16 linear kernel ----------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features", [960, 100, 16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 77, 300])
def test_linear_bf16_matches_float32(isa: str, rows: int, out_features: int, bias: bool) -> None:
    """Every path this CPU runs (AVX-512, AVX2, the portable loop), every register block of each
    (1-3 rows left over, a last group of fewer tiles, a last tile of fewer columns)."""
    gen = torch.Generator().manual_seed(rows * out_features)
    weight = (torch.randn(out_features, 576, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = torch.ops.sonar_cpu.linear_bf16(x, pack_native(weight), b, out_features)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # float32 accumulation, one rounding to bf16 at the end: within half a bf16 ulp of the exact sum
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [96, 80, 576, 1536])
@pytest.mark.parametrize("rows", [16, 17, 33, 128, 300])
def test_linear_bf16_amx_shapes(rows: int, in_features: int, bias: bool, threads: int) -> None:
    """The shapes the AMX path pads: a last block of fewer than 16 rows, K not a multiple of 32,
    N not a multiple of 16 (on a CPU without AMX the AVX-512 or AVX2 path runs them, the same
    bound; at K = 1536 the AVX2 path takes the rows in several chunks)."""
    out_features = 100 if in_features % 32 else 40
    gen = torch.Generator().manual_seed(rows * in_features + threads)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    amx = torch.ops.sonar_cpu.linear_amx_rows()
    assert bool(torch.ops.sonar_cpu.has_linear_amx()) == (amx > 0) == native.amx_bf16()
    if amx:
        assert amx <= rows  # these rows take the tile path
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.sonar_cpu.linear_bf16(x, pack_native(weight), b, out_features)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


def test_packed_linear_uses_the_native_layout_where_it_can() -> None:
    linear = nn.Linear(64, 48, dtype=torch.bfloat16)
    assert can_pack_native(linear.weight) == bool(torch.ops.sonar_cpu.has_linear_bf16())
    if not can_pack(linear.weight):  # neither AVX2 nor AVX-512 (not x86): the layers stay plain
        holder = nn.Sequential(linear)
        assert prepack_linears(holder) == 0 and holder[0] is linear
        return
    packed = PackedLinear(linear, batch_hint=16)
    assert packed.native_layout == bool(torch.ops.sonar_cpu.has_linear_bf16())
    odd = nn.Linear(63, 48, dtype=torch.bfloat16)
    assert not can_pack_native(odd.weight)
    if can_pack(odd.weight):  # an odd input width keeps oneDNN where its bfloat16 path runs (AVX-512)
        assert not PackedLinear(odd, batch_hint=16).native_layout
    else:  # an AVX2-only CPU: it stays a plain layer
        holder = nn.Sequential(odd)
        assert prepack_linears(holder) == 0 and holder[0] is odd
    x = torch.randn(5, 64).to(torch.bfloat16)
    torch.testing.assert_close(packed(x).float(), F.linear(x, linear.weight, linear.bias).float(), atol=0.06, rtol=1e-2)
    assert packed(x[:, None]).shape == (5, 1, 48)  # not a flat batch: F.linear


def test_linear_bf16_rejects_bad_input() -> None:
    weight = pack_native(torch.randn(32, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        torch.ops.sonar_cpu.linear_bf16(torch.randn(2, 64), weight, None, 32)
    with pytest.raises(RuntimeError, match="packed weights"):
        torch.ops.sonar_cpu.linear_bf16(torch.randn(2, 64).to(torch.bfloat16), weight, None, 40)


# --- the portable build --------------------------------------------------------------------------

PORTABLE_CHECK = """
import sys
import torch
torch.ops.load_library(sys.argv[1])
from sonar.kernels import attention, native, reference
from sonar.kernels.linear import pack_native

# the AVX2 path of the linear kernels is in every x86 build; the portable loop serves where it cannot run
avx2 = native.best_isa(native.cpu_flags()) != "portable"
assert bool(torch.ops.sonar_cpu.has_linear_bf16()) == avx2
gen = torch.Generator().manual_seed(0)
weight, x = torch.randn(40, 96, generator=gen).to(torch.bfloat16), torch.randn(5, 96, generator=gen).to(torch.bfloat16)
bias = torch.randn(40, generator=gen).to(torch.bfloat16)
want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
for path in ("portable", "avx2")[: 1 + avx2]:
    torch.ops.sonar_cpu.set_quant_isa(path)
    got = torch.ops.sonar_cpu.linear_bf16(x, pack_native(weight), bias, 40).float()
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-6).all(), path
for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
    x = torch.randn(7, 100, generator=gen).to(dtype)
    w = torch.randn(100, generator=gen).to(dtype)
    torch.testing.assert_close(torch.ops.sonar_cpu.rms_norm(x, w, 1e-5).float(),
                               reference.rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
    got = torch.ops.sonar_cpu.fused_add_rms_norm(x, x.flip(0).contiguous(), w, 1e-5)
    want = reference.rms_norm(x, w, 1e-5, x.flip(0).contiguous())
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=tol, rtol=tol)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(torch.ops.sonar_cpu.silu_and_mul(x).float(),
                               reference.silu_and_mul(x).float(), atol=tol, rtol=tol)
    qk = torch.randn(5, 6, 64, generator=gen).to(dtype)
    cos, sin = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    assert torch.equal(torch.ops.sonar_cpu.rotary(qk, cos, sin), reference.apply_rotary(qk, cos, sin))
    for head_dim in (64, 40):
        lens = [1, 20, 45]
        meta = attention.AttentionMetadata.build([1, 1, 1], lens, [[0], [3, 1], [2, 5, 4]], 16)
        cache = torch.randn(2, 6, 16, 2, head_dim, generator=gen).to(dtype)
        q = torch.randn(3, 6, head_dim, generator=gen).to(dtype)
        out = torch.empty_like(q)
        torch.ops.sonar_cpu.decode_attention(out, q, cache, meta.block_tables, meta.seq_lens,
                                             torch.empty(0, dtype=torch.int64), 0.2, -1)
        torch.testing.assert_close(out.float(), attention.paged_attention(q, cache, meta, 0.2).float(),
                                   atol=tol, rtol=tol)
    y, x = torch.randn(5, 24, generator=gen).to(dtype), torch.randn(5, 40, generator=gen).to(dtype)
    a = (torch.randn(3, 32, 40, generator=gen) / 6).to(dtype)
    b = (torch.randn(3, 24, 16, generator=gen) / 4).to(dtype)
    rows = torch.tensor([2, -1, 0, 1, 2])
    got, want = y.clone(), y.clone()
    torch.ops.sonar_cpu.lora_add(got, x, a, b, rows, [16, 8])
    reference.lora_add(want, x, a, b, rows, (16, 8))
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got[1], y[1]) and not torch.equal(got[0], y[0])
logits = torch.randint(0, 4, (3, 1000), generator=gen).float()
logits[1, 700] = float("nan")
best, index = torch.ops.sonar_cpu.row_max(logits)
want, want_index = logits.max(dim=-1)
torch.testing.assert_close(best, want, equal_nan=True, rtol=0, atol=0)
assert torch.equal(index, want_index)
print("ok")
"""


def test_portable_build_matches_the_references(portable_library: Path) -> None:
    """The kernels as a CPU without AVX-512 gets them, in a fresh process (one process can load one
    ``sonar_cpu`` library). The build is keyed by its flags, lands under its root, and a second
    call loads the cached library instead of compiling again."""
    compiler = native._compiler()
    assert compiler is not None and portable_library.name == native.LIBRARY_NAME
    assert portable_library.parent.name == native.build_key(compiler, PORTABLE_FLAGS)
    assert portable_library.parent.name != native.build_key(compiler)  # not the default build's key
    root = portable_library.parent.parent.parent
    stamp = portable_library.stat().st_mtime_ns
    assert native.build(root, flags=PORTABLE_FLAGS) == portable_library
    assert portable_library.stat().st_mtime_ns == stamp  # cached, not rebuilt
    assert not list(portable_library.parent.glob(".build-*"))  # no temporary file left behind
    assert native.available()
    assert_portable_check_passes(PORTABLE_CHECK, portable_library)


def assert_portable_check_passes(script: str, library: Path) -> None:
    """Run `script` (a check that prints ``ok``) with `library` as its argument in a fresh process:
    one process can load one ``sonar_cpu`` library, and this one loaded the default build."""
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script, str(library)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SONAR_NATIVE_KERNELS": "0"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
