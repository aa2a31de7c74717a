"""The CUDA backend of the quantized layers (`sonar.kernels.quant_triton`) and its Triton kernels,
run on CPU tensors by Triton's interpreter, against `sonar.kernels.quant.reference_linear`.

Tolerances: with float32 activations the kernel differs from the reference only by float32
summation order (and the scale applied to a tile's sum rather than to each weight), 1e-5 of the
output's scale; with bf16 activations both sides round the same float32 sums to bf16, so they
differ by at most about one bf16 step (2**-8 relative; 8e-3 allowed, 1e-3 of the output's scale
near zero). The shapes are small (N 48, K 128) so the interpreter takes seconds.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.kernels import quant
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantEmbedding, QuantLinear, backend_for, backends
from sonar.kernels.quant_triton import TritonBackend, pack_int4, scaled_mm_supported, unpack_int4
from sonar.kernels.triton import quant_matmul as qm

N, K = 48, 128
MS = (1, 5, 33)
ROOT = Path(__file__).resolve().parents[2]


def make_weight(
    fmt: str, group: int, offsets: bool, perm: bool = False, n: int = N, k: int = K, seed: int = 0
) -> QuantizedWeight:
    """Random values over the format's whole range, positive scales, offsets about the middle of
    the range (as GPTQ/AWQ zero points give)."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    if fmt == "int4":
        values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = 0.01 + 0.02 * torch.rand(n, groups, generator=gen)
    elif fmt == "int8":
        values = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scales = 0.0005 + 0.001 * torch.rand(n, groups, generator=gen)
    elif fmt == "mxfp4":  # every E2M1 code, powers of two 2^-8 .. 2^-4
        values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = quant.mxfp4_scales(torch.randint(120, 125, (n, groups), generator=gen))
    else:
        # e4m3 over its whole range, subnormals included
        values = (
            (torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-9, 8, (n, k), generator=gen)))
            .clamp(-448, 448)
            .to(torch.float8_e4m3fn)
        )
        scales = 0.001 + 0.01 * torch.rand(n, groups, generator=gen)
    offs = -scales * (7 + torch.rand(n, groups, generator=gen)) if offsets else None
    order = torch.randperm(k, generator=gen) if perm else None
    return QuantizedWeight(fmt, values, scales, offs, group, order)


def activations(m: int, dtype: torch.dtype, k: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item()
    tol = 1e-5 if want.dtype == torch.float32 else 8e-3
    atol = (1e-5 if want.dtype == torch.float32 else 1e-3) * scale
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=atol)


def test_the_kernels_are_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(qm._quant_matmul_kernel, InterpretedFunction)
    assert isinstance(qm._quantize_rows_fp8_kernel, InterpretedFunction)


# --- the GEMM through the backend ------------------------------------------------------------------


CASES = [
    ("int4", 32, True),
    ("int4", 128, False),
    ("int4", K, True),
    ("int8", 64, False),
    ("int8", K, True),
    ("fp8", K, False),
    ("fp8", 16, True),
    ("mxfp4", 32, False),
]


@pytest.mark.parametrize(
    ("fmt", "group", "offsets"), CASES, ids=[f"{f}-g{g}-{'off' if o else 'sym'}" for f, g, o in CASES]
)
def test_linear_matches_reference(fmt: str, group: int, offsets: bool) -> None:
    qw = make_weight(fmt, group, offsets)
    backend = TritonBackend()
    packed = backend.pack(qw)
    layer = QuantLinear(qw, None, backend=backend)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    for m in MS:
        for dtype in (torch.bfloat16, torch.float32):
            x = activations(m, dtype, seed=m)
            close(backend.linear(x, packed, layer.meta, None), quant.reference_linear(x, qw))
        x = activations(m, torch.bfloat16, seed=m)
        close(backend.linear(x, packed, layer.meta, bias), quant.reference_linear(x, qw, bias))


def test_every_fp8_value_decodes_exactly() -> None:
    """The kernel decodes e4m3 from its bits: every value but NaN, read back through an identity."""
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F] + [0, 0], dtype=torch.uint8)
    values = bits.view(torch.float8_e4m3fn).reshape(16, 16)
    qw = QuantizedWeight("fp8", values, torch.ones(16, 1), None, 16)
    got = TritonBackend().linear(torch.eye(16), TritonBackend().pack(qw), QuantLinear(qw, None).meta, None)
    assert torch.equal(got.t(), values.float())


def test_every_mxfp4_code_and_exponent_decodes_exactly() -> None:
    """The kernel decodes E2M1 codes and E8M0 exponents from their bits: each of the 16 codes under
    exponents from 0 (a subnormal scale, 2^-128) to 250, read back through an identity."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(6, 2)  # [6, 32]: one group per row
    exponents = torch.tensor([[0], [1], [100], [127], [128], [250]], dtype=torch.uint8)
    qw = QuantizedWeight("mxfp4", codes, quant.mxfp4_scales(exponents), None, 32)
    got = TritonBackend().linear(torch.eye(32), TritonBackend().pack(qw), QuantLinear(qw, None).meta, None)
    assert torch.equal(got.t(), quant.dequantize(qw))


def test_packed_layout_is_the_kernels() -> None:
    qw = make_weight("int4", 32, True)
    packed = TritonBackend().pack(qw)
    assert packed["qweight"].shape == (K // 2, N) and packed["qweight"].dtype == torch.uint8
    assert packed["scales"].shape == (K // 32, N) and packed["scales"].dtype == torch.float32
    assert packed["offsets"].shape == (K // 32, N)
    assert torch.equal(unpack_int4(packed["qweight"]), qw.values)
    assert torch.equal(packed["qweight"][0] & 0xF, qw.values[:, 0]) and torch.equal(
        packed["qweight"][0] >> 4, qw.values[:, 1]
    )
    int4 = sum(t.numel() * t.element_size() for t in packed.values())
    assert int4 == qw.nbytes  # two values a byte, float32 scales and offsets: nothing else kept
    fp8 = TritonBackend().pack(make_weight("fp8", K, False))
    assert "fp8_weight" not in fp8 and fp8["qweight"].shape == (K, N)  # _scaled_mm is CUDA-only
    mxfp4 = make_weight("mxfp4", 32, False)
    packed = TritonBackend().pack(mxfp4)
    assert set(packed) == {"qweight", "exponents"} and packed["exponents"].dtype == torch.uint8
    assert torch.equal(unpack_int4(packed["qweight"]), mxfp4.values)
    assert sum(t.numel() * t.element_size() for t in packed.values()) == mxfp4.nbytes  # 17 bytes per 32 weights


def test_act_order_layer_and_its_rows() -> None:
    """GPTQ act-order: the layer gathers x's columns; its rows (the tied embedding) come back in
    the input's column order."""
    qw = make_weight("int4", 32, True, perm=True)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    layer = QuantLinear(qw, bias, backend=TritonBackend())
    for m in MS:
        for dtype in (torch.bfloat16, torch.float16):
            x = activations(m, dtype, seed=10 + m)
            close(layer(x), quant.reference_linear(x, qw, bias))
    x3 = activations(6, torch.bfloat16).reshape(2, 3, K)
    close(layer(x3), quant.reference_linear(x3.reshape(6, K), qw, bias).reshape(2, 3, N))
    ids = torch.tensor([[3, 0], [47, 3]])
    want = quant.dequantize(qw, torch.bfloat16)[ids]
    assert torch.equal(QuantEmbedding(layer, torch.bfloat16)(ids), want)


@pytest.mark.parametrize(("fmt", "group", "offsets"), [("int8", 32, True), ("fp8", 64, False), ("mxfp4", 32, False)])
def test_rows_are_the_dequantized_rows(fmt: str, group: int, offsets: bool) -> None:
    qw = make_weight(fmt, group, offsets, perm=fmt == "int8")
    backend = TritonBackend()
    layer = QuantLinear(qw, None, backend=backend)
    index = torch.tensor([5, 0, 47, 5])
    assert torch.equal(layer.rows(index, torch.float32), quant.dequantize(qw)[index])


def test_k_splits_agree() -> None:
    """Decode-sized M splits K over programs (float32 partials summed by a second kernel, which
    adds the bias); every split count gives the reference."""
    qw = make_weight("int4", 16, True, k=256)
    packed = TritonBackend().pack(qw)
    x = activations(3, torch.bfloat16, k=256)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = quant.reference_linear(x, qw, bias)
    assert qm.choose_tiles(3, N, 256, 16, x.device)[3] > 1
    for splits in (1, 2, 4):
        got = qm.quant_matmul(x, packed["qweight"], packed["scales"], packed["offsets"], "int4", 16, bias, splits)
        close(got, want)
    with pytest.raises(ValueError, match="splits"):
        qm.quant_matmul(x, packed["qweight"], packed["scales"], packed["offsets"], "int4", 16, bias, splits=3)


def test_bad_shapes_are_refused() -> None:
    qw = make_weight("int8", 32, False)
    packed = TritonBackend().pack(qw)
    x = activations(2, torch.bfloat16)
    with pytest.raises(ValueError, match="group 8"):
        qm.quant_matmul(x, packed["qweight"], packed["scales"], None, "int8", 8)
    with pytest.raises(ValueError, match="do not fit"):
        qm.quant_matmul(x[:, :64], packed["qweight"], packed["scales"], None, "int8", 32)
    assert qm.quant_matmul(x[:0], packed["qweight"], packed["scales"], None, "int8", 32).shape == (0, N)


def test_pack_int4_round_trips() -> None:
    values = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(values)), values)


# --- FP8 activations for torch._scaled_mm ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_rows_fp8_is_torchs_rounding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 1500, generator=gen) * torch.tensor([[1.0], [1e-3], [300.0], [0.0]])).to(dtype)
    q, scale = qm.quantize_rows_fp8(x)
    want_scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
    assert torch.equal(scale, want_scale)
    want = (x.float() / want_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().amax(dim=1)[:3].eq(448).all()  # each row's largest value maps to e4m3's max


# --- which backend serves what -----------------------------------------------------------------------


def test_cpu_weights_are_not_served() -> None:
    qw = make_weight("int4", 32, False)
    assert any(isinstance(b, TritonBackend) for b in backends())
    assert not TritonBackend().serves(qw)
    assert not isinstance(backend_for(qw), TritonBackend)
    assert not scaled_mm_supported(torch.device("cpu"))


def test_groups_the_kernel_serves() -> None:
    assert qm.check_group(16, 128) and qm.check_group(128, 128) and qm.check_group(48, 96)
    assert not qm.check_group(8, 128) and not qm.check_group(24, 96) and not qm.check_group(64, 96)
    assert qm.choose_tiles(1, 1024, 1024, 48, torch.device("cpu"))[2] == 16  # BLOCK_K divides the group


# --- the GPU lowering, compiled on this CPU -------------------------------------------------------------


def record_gpu_launches(capability: int) -> list:
    """The launches the GPU path makes at Qwen3-0.6B's shapes on a 132-SM GPU: decode (K split,
    bf16), prefill with a bias (fp16 on Ampere), float32 activations, FP8 from its bits (the
    fallback of GPUs without FP8 matmuls), MXFP4 and, from 8.9 on, the per-token FP8 quantization;
    then quantized experts at Qwen3-30B-A3B's and gpt-oss-20b's shapes (16 of their experts): int4
    in groups of 32 with offsets (GGUF's Q4_1 / Q4_K) at decode and prefill, MXFP4 with GPT-OSS's
    biases and clamped SwiGLU."""
    from sonar.kernels.triton import aot, fused_moe

    # the package re-exports the function under the module's name: the module itself
    silu_and_mul = importlib.import_module("sonar.kernels.triton.silu_and_mul")
    sms, qm._num_sms = qm._num_sms, lambda device: 132
    try:
        with aot.recording([qm, fused_moe, silu_and_mul]) as launches:
            for fmt, m, dtype, bias in (
                ("int4", 1, torch.bfloat16, False),
                ("int8", 300, torch.bfloat16 if capability >= 89 else torch.float16, True),
                ("fp8", 40, torch.float32, False),
                ("fp8", 1, torch.bfloat16, False),
                ("mxfp4", 1, torch.bfloat16, False),
            ):
                group = 32 if fmt == "mxfp4" else 128
                qw = make_weight(fmt, group, fmt != "mxfp4", n=1024, k=3072)
                p = TritonBackend().pack(qw)
                b = torch.zeros(1024, dtype=dtype) if bias else None
                scales = p.get("scales", p.get("exponents"))
                qm.quant_matmul(
                    torch.zeros(m, 3072, dtype=dtype), p["qweight"], scales, p.get("offsets"), fmt, group, b
                )
            if capability >= 89:
                qm.quantize_rows_fp8(torch.zeros(2, 3072, dtype=torch.bfloat16))
            for fmt, h, inter, top_k, gpt_oss, tokens in (
                ("int4", 2048, 768, 8, False, (1, 64)),
                ("mxfp4", 2880, 2880, 4, True, (1,)),
            ):
                w13 = packed_experts(fmt, 2 * inter, h)
                w2 = packed_experts(fmt, h, inter)
                b13, b2 = (torch.zeros(16, 2 * inter), torch.zeros(16, h)) if gpt_oss else (None, None)
                for n in tokens:
                    ids = torch.arange(n * top_k).reshape(n, top_k) % 16
                    x = torch.zeros(n, h, dtype=torch.bfloat16)
                    fused_moe.fused_experts(x, torch.ones(n, top_k), ids, w13, w2, b13, b2, 7.0 if gpt_oss else None)
    finally:
        qm._num_sms = sms
    return launches


def packed_experts(fmt: str, n: int, k: int) -> Any:
    """16 experts' `TritonBackend` packings of an ``[n, k]`` weight, stacked as `QuantizedExperts`
    stacks them (one expert's packing repeated: only the shapes matter here)."""
    from sonar.kernels.quant_triton import scales_of
    from sonar.kernels.triton.fused_moe import PackedExperts

    p = TritonBackend().pack(make_weight(fmt, 32, fmt == "int4", n=n, k=k))
    offsets = p.get("offsets")
    return PackedExperts(
        fmt,
        32,
        k,
        p["qweight"].expand(16, -1, -1).contiguous(),
        scales_of(p).expand(16, -1, -1).contiguous(),
        None if offsets is None else offsets.expand(16, -1, -1).contiguous(),
    )


def compile_gpu_launches(capability: int) -> int:
    """Compile `record_gpu_launches` for `capability` (run without ``TRITON_INTERPRET``); prints
    one line per kernel, returns the number that failed."""
    from sonar.kernels.triton import aot

    aot._TYPES.setdefault(torch.int8, "i8")  # int8 weights: a pointer type aot's attention kernels never needed
    failed = 0
    for launch in record_gpu_launches(capability):
        label = launch.name + " " + " ".join(f"{k}={v}" for k, v in launch.kwargs.items() if k.isupper())
        try:
            aot.compile_launch(launch, capability)
            print("ok", label)
        except Exception as e:  # every failure reported
            failed += 1
            print("FAIL", label, f"{type(e).__name__}: {str(e)[:1000]}")
    return failed


@pytest.mark.parametrize("capability", [90, 80])
def test_kernels_compile_for_the_gpu(capability: int) -> None:
    """What the interpreter cannot check (dot shapes, layouts, shared memory, conversions that
    lower): the kernels compile for Hopper and Ampere, in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"import sys; from tests.kernels.test_quant_triton import compile_gpu_launches as c; sys.exit(c({capability}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.stdout.count("ok ") >= 12, proc.stdout
