"""The batched LoRA add (`sonar.kernels.lora`): the native CPU operator (the AVX512-BF16 path and
the plain loops), the Triton kernels under the interpreter and the torch reference, each against a
per-row, per-slot float64 computation written here; the dispatch between them.

Tolerances: float32 1e-5 (summation order only); float16 2e-3; bfloat16 2e-2 absolute and
relative — the shrink's result is rounded to bfloat16 (half an ulp, 2^-9 relative) before the
expand and the sum to bfloat16 once more, and Triton's interpreter truncates float32 to bfloat16
(a whole ulp, 2^-8 relative of ``|y|`` up to ~4)."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import lora, native, reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def per_row(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: list[int], splits: tuple[int, ...]
) -> torch.Tensor:
    """The contract, one row and one sub-projection at a time, in float64."""
    out = y.double().clone()
    rank = a.shape[1] // len(splits)
    for i, s in enumerate(rows):
        if s < 0:
            continue
        off = 0
        for j, size in enumerate(splits):
            t = a[s, j * rank : (j + 1) * rank].double() @ x[i].double()
            out[i, off : off + size] += b[s, off : off + size].double() @ t
            off += size
    return out


def case(
    rows: list[int], slots: int, rank: int, in_features: int, splits: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """``y, x, a, b, rows`` with deltas about as large as ``y`` (so a missed or doubled delta shows)."""
    gen = torch.Generator().manual_seed(seed)
    n, out = len(rows), sum(splits)
    x = torch.randn(n, in_features, generator=gen).to(dtype)
    a = (torch.randn(slots, len(splits) * rank, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = (torch.randn(slots, out, rank, generator=gen) / rank**0.5).to(dtype)
    y = torch.randn(n, out, generator=gen).to(dtype)
    return y, x, a, b, torch.tensor(rows, dtype=torch.int64)


def check(got: torch.Tensor, y: torch.Tensor, want: torch.Tensor, rows: list[int], dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    base = [i for i, s in enumerate(rows) if s < 0]
    assert torch.equal(got[base], y[base])  # rows without an adapter are untouched, bit for bit
    active = [i for i, s in enumerate(rows) if s >= 0]
    assert (got[active].double() - y[active].double()).abs().amax() > 10 * tol  # the deltas landed


MIXED = [2, -1, 0, 3, 3, -1, 1, 0, 2, 2, 0]  # slots mixed with rows of the base model


@pytest.fixture(autouse=True)
def _native_loaded(request: pytest.FixtureRequest) -> None:
    """The native tests call ``torch.ops.sonar_cpu`` directly: the library must be loaded (built
    here: a machine without a compiler fails them, as it fails tests/kernels/test_native.py)."""
    if "native" in request.node.name:
        assert native.available(), "the native kernels did not build here"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [16, 24, 5, 1])  # 24: not a multiple of 16; odd: the plain loops
@pytest.mark.parametrize("rows", [MIXED, [1]], ids=["mixed", "one_row"])
def test_native_matches_per_row(dtype: torch.dtype, rank: int, rows: list[int]) -> None:
    splits = (48, 16, 16)
    y, x, a, b, r = case(rows, 4, rank, 72, splits, dtype)
    got = y.clone()
    torch.ops.sonar_cpu.lora_add(got, x, a, b, r, list(splits))
    check(got, y, per_row(y, x, a, b, rows, splits), rows, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_many_rows_odd_sizes(dtype: torch.dtype) -> None:
    """A prefill-sized batch (rows of every slot in blocks and tails), an input size that is not a
    multiple of 32 and sub-projections that are not multiples of 16 (tiles straddle nothing)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(-1, 5, (301,), generator=gen).tolist()
    splits = (37, 21)
    y, x, a, b, r = case(rows, 5, 8, 101, splits, dtype, seed=1)
    got = y.clone()
    torch.ops.sonar_cpu.lora_add(got, x, a, b, r, list(splits))
    check(got, y, per_row(y, x, a, b, rows, splits), rows, dtype)


def test_native_smollm2_decode_shapes() -> None:
    """Serving's shapes: SmolLM2-135M's qkv (576 -> 576 + 192 + 192), 16 rows, 4 rank-16 slots."""
    rows = [0, 1, 2, 3, -1, 0, 1, 2, 3, -1, 0, 1, 2, 3, -1, 0]
    splits = (576, 192, 192)
    y, x, a, b, r = case(rows, 4, 16, 576, splits, torch.bfloat16, seed=2)
    got = y.clone()
    torch.ops.sonar_cpu.lora_add(got, x, a, b, r, list(splits))
    check(got, y, per_row(y, x, a, b, rows, splits), rows, torch.bfloat16)


def test_native_without_adapter_rows_changes_nothing() -> None:
    y, x, a, b, r = case([-1, -1, -1], 2, 16, 32, (16,), torch.bfloat16)
    got = y.clone()
    torch.ops.sonar_cpu.lora_add(got, x, a, b, r, [16])
    assert torch.equal(got, y)


def test_native_refuses_bad_input() -> None:
    y, x, a, b, r = case([0, 1], 2, 16, 32, (16, 16), torch.float32)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.sonar_cpu.lora_add(y, x.t().contiguous().t(), a, b, r, [16, 16])
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.sonar_cpu.lora_add(torch.randn(32, 2).t(), x, a, b, r, [16, 16])
    with pytest.raises(RuntimeError, match="slot 2 of 2"):
        torch.ops.sonar_cpu.lora_add(y, x, a, b, torch.tensor([0, 2]), [16, 16])
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.sonar_cpu.lora_add(y, x, a.bfloat16(), b, r, [16, 16])
    with pytest.raises(RuntimeError, match="a \\[S, 3 R"):
        torch.ops.sonar_cpu.lora_add(y, x, a, b, r, [10, 10, 12])  # 32 rows of a are not 3 ranks
    with pytest.raises(RuntimeError, match="b \\["):
        torch.ops.sonar_cpu.lora_add(y, x, a, b[:, :, :8].contiguous(), r, [16, 16])
    with pytest.raises(RuntimeError, match="y \\["):
        torch.ops.sonar_cpu.lora_add(y, x, a, b, r, [16, 8])


# --- B packed once (lora_pack_b) ------------------------------------------------------------------


def packed_by_hand(b: torch.Tensor, splits: tuple[int, ...]) -> torch.Tensor:
    """`lora.pack_b`'s layout built with torch: per sub-projection, tiles of 16 columns (zero past
    its end); float32 ``[S, tiles, R, 16]``, bfloat16 int32 pairs ``[S, tiles, ceil(R / 2), 16]``."""
    slots, _, rank = b.shape
    tiles, offset = [], 0
    for size in splits:
        part = b[:, offset : offset + size]
        padded = torch.zeros(slots, -(-size // 16) * 16, rank + rank % 2, dtype=b.dtype)
        padded[:, :size, :rank] = part
        tiles.append(padded.view(slots, -1, 16, padded.shape[2]))  # [S, tiles, 16, R']
        offset += size
    t = torch.cat(tiles, dim=1)
    if b.dtype == torch.float32:
        return t[..., :rank].transpose(2, 3).contiguous()
    halves = t.view(torch.int16).to(torch.int32) & 0xFFFF
    pairs = halves.view(*halves.shape[:3], -1, 2)  # [S, tiles, 16, P, 2]
    return (pairs[..., 0] | (pairs[..., 1] << 16)).transpose(2, 3).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [16, 5, 1])
def test_native_pack_b_layout(dtype: torch.dtype, rank: int) -> None:
    splits = (37, 21, 16)
    _, _, _, b, _ = case([0], 3, rank, 8, splits, dtype)
    packed = lora.pack_b(b, splits)
    assert torch.equal(packed, packed_by_hand(b, splits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [16, 5, 1])
def test_native_packed_b_gives_the_same_bits(dtype: torch.dtype, rank: int) -> None:
    """B packed once (what the adapter slots keep) or packed by the call: the same result, which
    is the contract's; a prefill-sized batch and odd sizes, as above."""
    gen = torch.Generator().manual_seed(6)
    rows = torch.randint(-1, 4, (67,), generator=gen).tolist()
    splits = (37, 21)
    y, x, a, b, r = case(rows, 4, rank, 101, splits, dtype, seed=3)
    unpacked, packed = y.clone(), y.clone()
    torch.ops.sonar_cpu.lora_add(unpacked, x, a, b, r, list(splits))
    torch.ops.sonar_cpu.lora_add(packed, x, a, b, r, list(splits), lora.pack_b(b, splits))
    assert torch.equal(packed, unpacked)
    check(packed, y, per_row(y, x, a, b, rows, splits), rows, dtype)
    dispatched = y.clone()
    lora.lora_add(dispatched, x, a, b, r, splits, lora.pack_b(b, splits))
    assert torch.equal(dispatched, packed)


def test_native_refuses_a_packed_b_that_does_not_fit() -> None:
    splits = (16, 16)
    y, x, a, b, r = case([0, 1], 2, 16, 32, splits, torch.bfloat16)
    packed = lora.pack_b(b, splits)
    for bad in (packed[:, :1].contiguous(), packed.float(), lora.pack_b(b.float(), splits)):
        with pytest.raises(RuntimeError, match="b_packed is lora_pack_b"):
            torch.ops.sonar_cpu.lora_add(y, x, a, b, r, list(splits), bad)
    y16, x16, a16, b16, _ = case([0, 1], 2, 16, 32, splits, torch.float16)
    with pytest.raises(RuntimeError, match="b_packed is lora_pack_b"):  # float16 is never packed
        torch.ops.sonar_cpu.lora_add(y16, x16, a16, b16, r, list(splits), packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 b"):
        torch.ops.sonar_cpu.lora_pack_b(b16, list(splits))
    with pytest.raises(RuntimeError, match=r"b \[S, 24, R\]"):
        torch.ops.sonar_cpu.lora_pack_b(b, [16, 8])


# --- dispatch and the reference ------------------------------------------------------------------


def test_dispatch_takes_the_native_kernel_and_handles_strided_inputs() -> None:
    rows = MIXED
    splits = (40, 24)
    y, x, a, b, r = case(rows, 4, 16, 64, splits, torch.bfloat16)
    native_out, dispatched = y.clone(), y.clone()
    torch.ops.sonar_cpu.lora_add(native_out, x, a, b, r, list(splits))
    lora.lora_add(dispatched, x, a, b, r, splits)
    assert native.available() and torch.equal(dispatched, native_out)
    # a strided x (a column slice) and a strided y: the reference, the same numbers within tolerance
    wide = torch.cat((x, x), dim=1)
    strided_y = torch.cat((y, y), dim=1)[:, : sum(splits)]
    lora.lora_add(strided_y, wide[:, :64], a, b, r, splits)
    check(strided_y, y, per_row(y, x, a, b, rows, splits), rows, torch.bfloat16)


def test_reference_matches_per_row_in_float64_and_mixed_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = MIXED
    splits = (24, 8, 8)
    y, x, a, b, r = case(rows, 4, 5, 40, splits, torch.float64)
    got = y.clone()
    lora.lora_add(got, x, a, b, r, splits)  # float64: the reference
    torch.testing.assert_close(got, per_row(y, x, a, b, rows, splits), atol=1e-12, rtol=1e-12)
    # adapters kept in float32 beside a bfloat16 model (--lora-dtype): computed in float32, the
    # delta added to bfloat16 rows
    y16, x16 = y.bfloat16(), x.bfloat16()
    got = y16.clone()
    lora.lora_add(got, x16, a.float(), b.float(), r, splits)
    check(got, y16, per_row(y16, x16, a.float(), b.float(), rows, splits), rows, torch.bfloat16)
    # the native kernels off: the reference, bit for bit
    monkeypatch.setenv(native.ENV, "0")
    y32, x32, a32, b32 = y.float(), x.float(), a.float(), b.float()
    got, want = y32.clone(), y32.clone()
    lora.lora_add(got, x32, a32, b32, r, splits)
    reference.lora_add(want, x32, a32, b32, r, splits)
    assert torch.equal(got, want)
    check(got, y32, per_row(y32, x32, a32, b32, rows, splits), rows, torch.float32)


# --- Triton, under the interpreter ---------------------------------------------------------------


def test_triton_kernels_are_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from sonar.kernels.triton import lora as triton_lora

    assert isinstance(triton_lora._lora_shrink_kernel, InterpretedFunction)
    assert isinstance(triton_lora._lora_expand_kernel, InterpretedFunction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rank", "splits"), [(16, (40, 8, 8)), (5, (24,)), (3, (9, 7, 7, 5))])
def test_triton_matches_per_row(dtype: torch.dtype, rank: int, splits: tuple[int, ...]) -> None:
    from sonar.kernels.triton import lora_add

    rows = [1, -1, 0, 2, 2, -1, 0]
    y, x, a, b, r = case(rows, 3, rank, 40, splits, dtype)
    got = y.clone()
    lora_add(got, x, a, b, r, splits)
    check(got, y, per_row(y, x, a, b, rows, splits), rows, dtype)


def test_triton_refuses_what_it_does_not_take() -> None:
    from sonar.kernels.triton import LORA_MAX_SPLITS, lora_add

    splits = (4,) * (LORA_MAX_SPLITS + 1)
    y, x, a, b, r = case([0], 1, 2, 8, splits, torch.float32)
    with pytest.raises(ValueError, match="sub-projections"):
        lora_add(y, x, a, b, r, splits)
    y, x, a, b, r = case([0], 1, 2, 8, (4,), torch.float32)
    with pytest.raises(ValueError, match="shapes"):
        lora_add(y, x, a, b, r, (3,))


# The split form the fully sharded layers exchange between tensor-parallel ranks (`shrink`, `expand`).


def test_shrink_then_expand_is_each_rows_delta() -> None:
    g = torch.Generator().manual_seed(0)
    slots, rank, fan_in, splits = 3, 4, 24, (8, 5, 5)
    a = torch.randn(slots, len(splits) * rank, fan_in, generator=g)
    b = torch.randn(slots, sum(splits), rank, generator=g)
    x = torch.randn(6, fan_in, generator=g)
    rows = torch.tensor([2, -1, 0, 2, 1, -1])
    base = torch.randn(6, sum(splits), generator=g)
    y = base.clone()
    t = lora.shrink(x, a, rows)
    lora.expand(y, t, b, rows, splits)
    for i, slot in enumerate(rows.tolist()):
        expected = base[i].clone()
        if slot >= 0:
            offset = 0
            for j, split in enumerate(splits):
                down = a[slot, j * rank : (j + 1) * rank]
                expected[offset : offset + split] += b[slot, offset : offset + split] @ (down @ x[i])
                offset += split
        else:
            assert not t[i].any()
        torch.testing.assert_close(y[i], expected, rtol=1e-5, atol=1e-5)


def test_expand_writes_through_a_column_view() -> None:
    """A row-parallel rank adds its slice of the output columns into the base layer's output."""
    a = torch.ones(1, 2, 3)
    b = torch.ones(1, 4, 2)
    x = torch.ones(2, 3)
    rows = torch.tensor([0, -1])
    y = torch.zeros(2, 8)
    lora.expand(y.narrow(1, 4, 4), lora.shrink(x, a, rows), b, rows, (4,))
    assert y[0].tolist() == [0, 0, 0, 0, 6, 6, 6, 6] and not y[1].any()
