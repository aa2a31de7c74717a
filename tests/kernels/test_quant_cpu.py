"""The native quantized linear kernel (``torch.ops.sonar_cpu.linear_quant``, `sonar.kernels.quant_cpu`)
against `sonar.kernels.quant.reference_linear`: every format and group size, with and without
offsets, act-order, bias, row counts around the register blocks, a tile count not a multiple of
16; exactly where every sum is exact; `rows` against `dequantize`; every path this CPU can run
(portable, AVX2, AVX-512: `sonar.kernels.native.set_quant_isa`) in bfloat16 and float32; the
selection of the path from the CPU's flags; the portable build.

Tolerance (compared in float32): float32 rounding of the sums, at most about 2 K 2^-24 < 3e-5 of
sum |x| |w| (K = 256); with bfloat16 output both sides round a float32 sum to bfloat16, so they may
differ by one bfloat16 step (2^-7 relative) more. For int8 weights and bfloat16 x the AVX-512 and
portable paths also quantize x to int8 per row and group (scale_x = max |x| / 127, rounded to
nearest): each x is off by at most scale_x / 2, so a group's sum by at most scale_x / 2 * sum |w|
over the group, and the output by the sum of that over the groups.

mxfp4 (GGUF's MXFP4: 4-bit E2M1 codes, one E8M0 exponent per 32) on every path, bfloat16 and
float32 x, the same float32 bound (it never rounds x), exact where every sum is; its packing 17
bytes per 32 weights; every exponent byte (subnormal scales included) read back exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sonar.kernels import native, quant, quant_cpu
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantEmbedding, QuantLinear, ReferenceBackend
from tests.kernels.conftest import RUNNABLE
from tests.kernels.test_native import assert_portable_check_passes

pytestmark = pytest.mark.usefixtures("one_thread")

N, K = 37, 256
GROUPS = [16, 32, 64, 128, K]
ROWS = [1, 3, 4, 5, 17, 300]


def _values(fmt: str, shape: tuple[int, int], gen: torch.Generator, small: bool = False) -> torch.Tensor:
    if fmt == "int4":
        return torch.randint(0, 4 if small else 16, shape, generator=gen, dtype=torch.uint8)
    if fmt == "int8":
        return torch.randint(-4 if small else -128, 4 if small else 128, shape, generator=gen, dtype=torch.int8)
    if small:
        return torch.randint(-4, 4, shape, generator=gen).float().to(torch.float8_e4m3fn)
    # every e4m3 value but NaN: subnormals, zeros of both signs, the extremes
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    bits = torch.where((bits & 0x7F) == 0x7F, bits & 0xFE, bits)
    return bits.view(torch.float8_e4m3fn)


def random_weight(
    fmt: str, group: int, offsets: bool, perm: bool = False, n: int = N, k: int = K, seed: int = 0
) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    scales = torch.rand(n, groups, generator=gen) * 0.1 + 0.01
    return QuantizedWeight(
        fmt,
        _values(fmt, (n, k), gen),
        scales,
        torch.randn(n, groups, generator=gen) * 0.1 if offsets else None,
        group,
        torch.randperm(k, generator=gen) if perm else None,
    )


def exact_weight(fmt: str, group: int, offsets: bool, gen: torch.Generator) -> QuantizedWeight:
    """Small values, power-of-two scales, offsets on a 1/4 grid: with small integer x every
    product and sum is exact in float32."""
    groups = K // group
    return QuantizedWeight(
        fmt,
        _values(fmt, (N, K), gen, small=True),
        2.0 ** torch.randint(-2, 2, (N, groups), generator=gen).float(),
        torch.randint(-8, 8, (N, groups), generator=gen).float() / 4 if offsets else None,
        group,
    )


def quantization_error_bound(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """[rows, N]: the most that quantizing x per group (int8 weights, bfloat16 x) moves x @ w.T,
    the sum over groups of scale_x / 2 * sum |w| (zero for int4 and fp8, and for float32 x: those
    stay unrounded)."""
    rows, k = x.shape
    if qw.format != "int8" or x.dtype != torch.bfloat16:
        return torch.zeros(rows, qw.values.shape[0])
    w = quant.dequantize(qw).abs()  # in x's column order (act-order gathers x's columns)
    xg = (x.float() if qw.perm is None else x.float()[:, qw.perm]).reshape(rows, -1, qw.group)
    half_step = xg.abs().amax(dim=2) / 127 / 2  # [rows, G]
    wg = (w if qw.perm is None else w[:, qw.perm]).reshape(w.shape[0], -1, qw.group).sum(dim=2)  # [N, G]
    return half_step @ wg.T


def assert_close_to_reference(
    got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None
) -> None:
    want = quant.reference_linear(x, qw, bias).float()
    spread = x.float().abs() @ quant.dequantize(qw).abs().T
    step = 2**-7 if x.dtype == torch.bfloat16 else 0.0
    bound = step * want.abs() + 3e-5 * spread + quantization_error_bound(x, qw) + 1e-6
    error = (got.float() - want).abs()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert bool((error <= bound).all()), f"error up to {(error / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("offsets", [False, True])
def test_linear_matches_the_reference(fmt: str, group: int, offsets: bool) -> None:
    gen = torch.Generator().manual_seed(group)
    for perm in (False, True):
        qw = random_weight(fmt, group, offsets, perm, seed=group + perm)
        layer = QuantLinear(qw, None)
        assert layer.backend.name == "native"
        for rows in ROWS:
            x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
            bias = torch.randn(N, generator=gen).to(torch.bfloat16) if rows % 2 else None
            layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            assert_close_to_reference(layer(x), x, qw, bias)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("group", [16, K])
def test_exact_where_every_sum_is(fmt: str, group: int) -> None:
    """Every product and sum exact in float32 on both sides (`exact_weight`; integer x within
    +-127 whose every group holds a 127, so that int8 quantization with scale_x = 1 keeps it):
    the bfloat16 outputs are equal."""
    gen = torch.Generator().manual_seed(3)
    for offsets in (False, True):
        qw = exact_weight(fmt, group, offsets, gen)
        layer = QuantLinear(qw, torch.randint(-3, 3, (N,), generator=gen).to(torch.bfloat16))
        for rows in (1, 4, 7, 16, 40):
            assert torch.equal(layer(x := exact_x(rows, group, gen)), quant.reference_linear(x, qw, layer.bias))


def exact_x(rows: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """Integers within +-127, each group's first one 127 (or -127): they quantize exactly."""
    x = torch.randint(-127, 128, (rows, K), generator=gen)
    x.view(rows, -1, group)[..., 0] = 127 * (torch.randint(0, 2, (rows, K // group), generator=gen) * 2 - 1)
    return x.to(torch.bfloat16)


def test_many_tiles_and_a_wide_input() -> None:
    """Several tiles per thread and a tail tile: SmolLM2's down projection shape, cut to 600 rows."""
    qw = random_weight("int4", 32, True, n=600, k=1536, seed=5)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert_close_to_reference(QuantLinear(qw, None)(x), x, qw, None)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("group", [16, 64, K])
def test_rows_are_the_dequantized_rows(fmt: str, group: int) -> None:
    """`rows` dequantizes out of the packing exactly as `dequantize` does out of the logical
    layout; the tied embedding reads through it."""
    for offsets, perm in ((False, False), (True, True)):
        qw = random_weight(fmt, group, offsets, perm, seed=7)
        layer = QuantLinear(qw, None)
        index = torch.tensor([0, 36, 17, 5, 5, 16, 15])
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(layer.rows(index, dtype), quant.dequantize(qw, dtype)[index])
        embedding = QuantEmbedding(layer, torch.bfloat16)
        ids = index.reshape(1, 7)
        assert torch.equal(embedding(ids), quant.dequantize(qw, torch.bfloat16)[index].reshape(1, 7, K))


def test_packing_holds_the_layout_unchanged() -> None:
    qw = random_weight("int4", 32, True, n=40)
    packed = quant_cpu.pack(qw)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, K // 32, 4 * 64 + 2 * 64)
    assert qw.nbytes <= packed.numel() < qw.nbytes * 1.25  # the padding of the last tile only
    back = quant_cpu.unpack_rows(packed, QuantLinear(qw, None).meta, torch.arange(40))
    assert torch.equal(back.values, qw.values) and torch.equal(back.scales, qw.scales)
    assert torch.equal(back.offsets, qw.offsets)


def test_other_activation_dtypes_take_the_reference() -> None:
    qw = random_weight("int8", 32, True, perm=True)
    x = torch.randn(3, K).to(torch.float16)
    assert torch.equal(QuantLinear(qw, None)(x), quant.reference_linear(x, qw))


# --- the paths: portable, AVX2, AVX-512 ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_every_path_matches_the_reference(isa: str, dtype: torch.dtype, fmt: str) -> None:
    assert native.quant_isa() == isa
    gen = torch.Generator().manual_seed(11)
    for group, offsets, perm in ((16, True, False), (32, False, True), (64, True, True), (K, True, False)):
        qw = random_weight(fmt, group, offsets, perm, seed=group)
        layer = QuantLinear(qw, None)
        for rows in (1, 2, 3, 4, 5, 8, 17):
            x = torch.randn(rows, K, generator=gen).to(dtype)
            bias = torch.randn(N, generator=gen).to(dtype) if rows % 2 else None
            layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            assert_close_to_reference(layer(x), x, qw, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_path_is_exact_where_every_sum_is(isa: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    for fmt in ("int4", "int8", "fp8"):
        for group, offsets in ((16, True), (K, False)):
            qw = exact_weight(fmt, group, offsets, gen)
            layer = QuantLinear(qw, torch.randint(-3, 3, (N,), generator=gen).to(dtype))
            for rows in (1, 3, 4, 9):
                x = exact_x(rows, group, gen).to(dtype)
                assert torch.equal(layer(x), quant.reference_linear(x, qw, layer.bias)), (fmt, group, rows)


def test_the_path_follows_the_cpus_flags() -> None:
    """What the library runs by default is what `best_isa` reads from the CPU's flags; the choice
    itself, for the CPUs CI has (AVX-512 with BF16 and VNNI, AVX2-only) and older ones."""
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    assert native.best_isa(zen4) == "avx512"
    assert native.best_isa(zen4 - {"avx512_bf16"}) == "avx2"  # the AVX-512 path needs bfloat16 pairs
    assert native.best_isa(avx2) == "avx2"
    assert native.best_isa(avx2 - {"fma"}) == "portable"
    assert native.best_isa(frozenset()) == "portable"
    if native.cpu_flags():
        assert native.quant_isa() == native.best_isa(native.cpu_flags())


def test_a_path_the_cpu_cannot_run_is_refused() -> None:
    for name in ("avx1024", *(i for i in native.ISAS if i not in RUNNABLE)):
        with pytest.raises(native.NativeIsaError, match=f"SONAR_CPU_ISA={name}"):
            native.set_quant_isa(name)
    assert native.quant_isa() == RUNNABLE[-1]


def test_what_the_backend_does_not_serve() -> None:
    """A group that is not whole lines of the packing (int4: 8 columns, int8: 4) goes to the
    reference backend; so does everything when the native kernels are off."""
    odd = random_weight("int4", 4, False, k=64)
    assert not quant_cpu.NativeBackend().serves(odd)
    assert QuantLinear(odd, None).backend.name == "reference"
    assert quant_cpu.NativeBackend().serves(random_weight("int8", 4, False, k=64))
    assert quant_cpu.NativeBackend().serves(random_weight("fp8", 32, False))


def test_bad_input_is_refused() -> None:
    qw = random_weight("int4", 32, True)
    packed = quant_cpu.pack(qw)
    x = torch.randn(2, K).to(torch.bfloat16)
    op = torch.ops.sonar_cpu.linear_quant
    with pytest.raises(RuntimeError, match="bfloat16 or float32 x"):
        op(x.half(), packed, None, 0, N, 32, True)
    with pytest.raises(RuntimeError, match="bias"):
        op(x.float(), packed, torch.zeros(N, dtype=torch.bfloat16), 0, N, 32, True)
    with pytest.raises(RuntimeError, match="bytes per group"):
        op(x, packed, None, 0, N, 32, False)  # offsets missing from the packing
    with pytest.raises(RuntimeError, match="output features"):
        op(x, packed, None, 0, 60, 32, True)
    with pytest.raises(RuntimeError, match="format"):
        op(x, packed, None, 4, N, 32, True)
    with pytest.raises(RuntimeError, match="mxfp4 has no offsets"):
        op(x, packed, None, 3, N, 32, True)
    with pytest.raises(RuntimeError, match="not a multiple"):
        op(x, packed, None, 0, N, 12, True)


def test_the_reference_backend_agrees() -> None:
    """The two backends on one weight (the native one within the stated tolerance)."""
    qw = random_weight("fp8", 64, True, perm=True)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.equal(QuantLinear(qw, None, backend=ReferenceBackend())(x), quant.reference_linear(x, qw))
    assert_close_to_reference(QuantLinear(qw, None)(x), x, qw, None)


# --- the portable build --------------------------------------------------------------------------

PORTABLE_CHECK = """
import sys
import torch
torch.ops.load_library(sys.argv[1])
from sonar.kernels import quant, quant_cpu
from tests.kernels.test_quant_cpu import (
    K, N, assert_close_to_reference, exact_weight, exact_x, mxfp4_weight, random_weight
)

assert not torch.ops.sonar_cpu.has_linear_quant()
torch.ops.sonar_cpu.set_quant_isa("portable")
gen = torch.Generator().manual_seed(0)
for fmt in ("int4", "int8", "fp8"):
    for group, offsets in ((16, True), (32, False), (K, True)):
        qw = random_weight(fmt, group, offsets)
        packed = quant_cpu.pack(qw)
        for rows in (1, 5):
            x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
            bias = torch.randn(N, generator=gen).to(torch.bfloat16)
            got = torch.ops.sonar_cpu.linear_quant(x, packed, bias, quant_cpu.FORMAT_CODES[fmt], N, group, offsets)
            assert_close_to_reference(got, x, qw, bias)
    small = exact_weight(fmt, 16, True, gen)
    x = exact_x(3, 16, gen)
    got = torch.ops.sonar_cpu.linear_quant(x, quant_cpu.pack(small), None, quant_cpu.FORMAT_CODES[fmt], N, 16, True)
    assert torch.equal(got, quant.reference_linear(x, small)), fmt
qw = mxfp4_weight(N, K, gen)
for dtype in (torch.bfloat16, torch.float32):
    x = torch.randn(5, K, generator=gen).to(dtype)
    got = torch.ops.sonar_cpu.linear_quant(x, quant_cpu.pack(qw), None, 3, N, 32, False)
    assert_close_to_reference(got, x, qw, None)
print("ok")
"""


def test_portable_build_matches_the_reference(portable_library: Path) -> None:
    """The kernel as a CPU without AVX-512 gets it (``-mno-avx512f``; the portable loop forced: the
    AVX2 path is compiled in regardless and chosen where the CPU has it), in a fresh process (one
    process can load one ``sonar_cpu`` library)."""
    assert_portable_check_passes(PORTABLE_CHECK, portable_library)


def test_replace_keeps_perm_semantics() -> None:
    """An act-order weight is the plain weight with its columns permuted: x[:, perm] @ w.T."""
    qw = random_weight("int4", 32, True, seed=9)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(9))
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    permuted = QuantLinear(replace(qw, perm=perm), None)(x)
    assert torch.equal(permuted, QuantLinear(qw, None)(x[:, perm].contiguous()))


def test_the_environment_picks_the_path() -> None:
    """``SONAR_CPU_ISA`` at load (a fresh process: the library reads it once); an unknown name is
    refused with a message naming the variable."""
    import os
    import subprocess
    import sys

    script = "from sonar.kernels import native; print(native.quant_isa())"
    for name, want in (("portable", "portable"), ("auto", RUNNABLE[-1])):
        env = {**os.environ, native.ISA_ENV: name}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0 and proc.stdout.split()[-1] == want, proc.stderr[-2000:]
    env = {**os.environ, native.ISA_ENV: "avx1024"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "SONAR_CPU_ISA=avx1024" in proc.stderr


# --- mxfp4 ---------------------------------------------------------------------------------------


def mxfp4_weight(n: int, k: int, gen: torch.Generator, exponents: tuple[int, int] = (120, 132)) -> QuantizedWeight:
    """Random E2M1 codes and E8M0 exponents in `exponents` (scales 2^(e - 128)), groups of 32."""
    e = torch.randint(*exponents, (n, k // 32), generator=gen).to(torch.uint8)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return QuantizedWeight("mxfp4", codes, quant.mxfp4_scales(e), None, 32)


# (N, K): a partial tile of 16 output rows, one tile and one group, several tiles
MXFP4_SHAPES = [(N, K), (16, 32), (50, 96)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_every_path_matches_the_reference(isa: str, dtype: torch.dtype) -> None:
    """Against `reference_linear` on the dequantized weight, in the float32 bound of
    `assert_close_to_reference` (no x rounding on any path), with and without a bias."""
    gen = torch.Generator().manual_seed(21)
    for n, k in MXFP4_SHAPES:
        qw = mxfp4_weight(n, k, gen)
        layer = QuantLinear(qw, None)
        assert layer.backend.name == "native"
        for rows in (1, 2, 3, 4, 5, 8, 17):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
            layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
            assert_close_to_reference(layer(x), x, qw, bias)


def test_mxfp4_is_exact_where_every_sum_is(isa: str) -> None:
    """Scales 2^-2 .. 2^1 and integer x: every product and sum exact, so the outputs are equal."""
    gen = torch.Generator().manual_seed(22)
    qw = mxfp4_weight(N, K, gen, exponents=(126, 130))
    layer = QuantLinear(qw, None)
    for rows in (1, 3, 4, 9):
        x = torch.randint(-8, 9, (rows, K), generator=gen).float()
        assert torch.equal(layer(x), quant.reference_linear(x, qw)), rows


def test_mxfp4_packing_is_17_bytes_per_32_weights_and_reads_back_exactly() -> None:
    """Every exponent byte 0..255 (2^-128, a float32 subnormal, to 2^127) and every code: the
    native packing (16-row tiles: 64 rows for 50) and the reference backend's hold 17 bytes per 32
    weights, and their `rows` are `dequantize`'s exactly."""
    gen = torch.Generator().manual_seed(23)
    n, k = 50, 32 * 6  # 300 groups: every exponent byte, some twice
    e = torch.arange(n * k // 32).remainder(256).to(torch.uint8).reshape(n, k // 32)
    qw = QuantizedWeight(
        "mxfp4", torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), quant.mxfp4_scales(e), None, 32
    )
    assert qw.nbytes == n * k // 32 * 17
    native_layer, reference_layer = QuantLinear(qw, None), QuantLinear(qw, None, backend=ReferenceBackend())
    assert native_layer.nbytes == 64 * k // 32 * 17
    assert reference_layer.nbytes == n * k // 32 * 17
    index = torch.arange(n)
    for layer in (native_layer, reference_layer):
        assert torch.equal(layer.rows(index, torch.float32), quant.dequantize(qw))
    assert torch.equal(quant_cpu.unpack_rows(quant_cpu.pack(qw), native_layer.meta, index).scales, qw.scales)


def test_mxfp4_weights_that_are_not_mxfp4_are_refused() -> None:
    gen = torch.Generator().manual_seed(24)
    qw = mxfp4_weight(16, 64, gen)
    with pytest.raises(quant.QuantizationError, match="powers of two"):
        quant_cpu.pack(replace(qw, scales=qw.scales * 3))
    with pytest.raises(quant.QuantizationError, match="neither offsets"):
        replace(qw, offsets=torch.zeros_like(qw.scales))
    with pytest.raises(quant.QuantizationError, match="cannot stack"):
        quant.stack_rows([qw, random_weight("int4", 32, False, n=16, k=64)])
    assert quant.stack_rows([qw, qw]).format == "mxfp4"
