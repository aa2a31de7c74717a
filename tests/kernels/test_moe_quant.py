"""The grouped quantized MoE operator (``torch.ops.sonar_cpu.moe_quant``, run by
`sonar.models.moe.QuantizedExperts`) against the per-expert path (each active expert's rows through
its own `QuantLinear`s, `QuantizedExperts.per_expert`) and against the dequantized
`sonar.kernels.moe.fused_experts_reference`: int4, int8, fp8 and mxfp4 experts, with offsets and
without, a partial tile, -1 ids (another rank's experts), an expert no token chose, top_k 1 and 2,
experts with 8 rows and more (the AVX-512 tiles' blocks of 8 rows, fp8's unpacked tiles from 32),
GPT-OSS's biases and clamped SwiGLU, bfloat16 and float32 x, on every path this CPU runs
(`sonar.kernels.native.set_quant_isa`: the portable loop, AVX2 and, on a CPU with AVX512-BF16 and
VNNI, AVX-512), and in the portable build (``-mno-avx512f``). The fallbacks: experts whose
packings differ, float16 x, the kernels off.

Against the per-expert path, on one thread (the module's `one_thread`):

* silu-and-mul experts: bit for bit. Each projection runs linear_quant's tile code for x's dtype on
  the chosen path (AVX-512: int8 x quantized per group as linear_quant quantizes it), blocked as
  linear_quant blocks it on one thread; every product, activation and bias sum is rounded at the
  same points and the weighted sum is added in the same order.
* GPT-OSS's clamped SwiGLU: its sigmoid is ``std::exp`` in the kernel and torch's vectorized exp
  in the per-expert path, so a value may differ in the last bit: float32 x 1e-5 of the output's
  largest magnitude (``scale``); bfloat16 x 2^-7 of each value plus 2^-7 of ``scale`` (a float32
  difference of one ulp may flip one rounding to bfloat16, 2^-8 of an intermediate, and the
  output's rounding by one step).

Against the dequantized reference in float32: float32 x 1e-4, bfloat16 x 2^-5 of ``scale`` (the
intermediates rounded to bfloat16, twice over two GEMMs; int8 experts also carry x's int8
quantization on the AVX-512 and portable paths).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import torch

from sonar.kernels import native, quant
from sonar.kernels.moe import fused_experts_reference
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantLinear
from sonar.models.moe import QuantizedExperts
from tests.kernels.test_native import assert_portable_check_passes
from tests.kernels.test_quant_cpu import mxfp4_weight, random_weight

pytestmark = pytest.mark.usefixtures("one_thread", "native_built")

LIMIT, ALPHA = 7.0, 1.702
# (gate_up format, down format, group, offsets, h, I): int formats on an h of 4.5 tiles (a partial
# tile in the down projection); mxfp4 in its groups of 32
CASES = [
    ("int4", "int4", 8, True, 72, 40),
    ("int8", "int8", 8, False, 72, 40),
    ("fp8", "fp8", 8, False, 72, 40),
    ("int4", "int8", 16, True, 64, 48),
    ("mxfp4", "mxfp4", 32, False, 96, 64),
]


def weight(fmt: str, group: int, offsets: bool, n: int, k: int, seed: int) -> QuantizedWeight:
    if fmt == "mxfp4":
        return mxfp4_weight(n, k, torch.Generator().manual_seed(seed), exponents=(122, 128))
    qw = random_weight(fmt, group, offsets, n=n, k=k, seed=seed)
    # scales that keep the activations moderate over two GEMMs (int8's codes reach 127)
    return QuantizedWeight(qw.format, qw.values, qw.scales / (32 if fmt == "int8" else 4), qw.offsets, qw.group)


def make_experts(
    case: tuple[str, str, int, bool, int, int], experts: int, gpt_oss: bool, dtype: torch.dtype
) -> tuple[QuantizedExperts, list[QuantizedWeight], list[QuantizedWeight]]:
    fmt13, fmt2, group, offsets, h, inter = case
    block = QuantizedExperts(
        experts,
        h,
        inter,
        swiglu_limit=LIMIT if gpt_oss else None,
        swiglu_alpha=ALPHA,
        bias_device=torch.device("cpu"),
        bias_dtype=dtype,
    )
    w13, w2 = [], []
    for e, expert in enumerate(block):
        w13.append(weight(fmt13, group, offsets, 2 * inter, h, seed=2 * e))
        w2.append(weight(fmt2, group, offsets, h, inter, seed=2 * e + 1))
        expert.gate_up_proj = QuantLinear(w13[-1], None)
        expert.down_proj = QuantLinear(w2[-1], None)
    if gpt_oss:
        gen = torch.Generator().manual_seed(7)
        assert block.gate_up_proj_bias is not None and block.down_proj_bias is not None
        block.gate_up_proj_bias.data.copy_(torch.randn(experts, 2 * inter, generator=gen))
        block.down_proj_bias.data.copy_(torch.randn(experts, h, generator=gen))
    return block, w13, w2


def routing(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token among all but the last (which no token chooses); some pairs -1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    weights = torch.rand(ids.shape, generator=gen)
    return weights, ids


def reference(
    w13: list[QuantizedWeight],
    w2: list[QuantizedWeight],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: QuantizedExperts | None = None,
) -> torch.Tensor:
    """fused_experts_reference on the dequantized weights in float32 (with `block`'s biases and
    activation)."""
    b13 = b2 = limit = None
    if block is not None and block.swiglu_limit is not None:
        assert block.gate_up_proj_bias is not None and block.down_proj_bias is not None
        b13, b2, limit = block.gate_up_proj_bias.float(), block.down_proj_bias.float(), block.swiglu_limit
    return fused_experts_reference(
        x.float(),
        weights,
        ids,
        torch.stack([quant.dequantize(w) for w in w13]),
        torch.stack([quant.dequantize(w) for w in w2]),
        b13,
        b2,
        swiglu_limit=limit,
        swiglu_alpha=ALPHA,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-g{c[2]}{'-offsets' if c[3] else ''}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
def test_grouped_equals_per_expert_and_reference(
    isa: str, case: tuple[str, str, int, bool, int, int], dtype: torch.dtype, gpt_oss: bool
) -> None:
    experts = 5
    block, w13, w2 = make_experts(case, experts, gpt_oss, dtype)
    gen = torch.Generator().manual_seed(3)
    for tokens, top_k in ((1, 1), (1, 2), (6, 2), (37, 2), (9, 1), (96, 2)):
        x = torch.randn(tokens, case[4], generator=gen).to(dtype)
        weights, ids = routing(tokens, top_k, experts, seed=tokens + top_k)
        got = block(x, weights, ids)
        assert block.stacked() is not None, "the grouped operator did not run"
        scale = assert_near_reference(got, block, w13, w2, x, weights, ids)
        per_expert = block.per_expert(x, weights, ids)
        if not gpt_oss:
            differ = int((got != per_expert).sum())
            assert differ == 0, f"{tokens} tokens, top_k {top_k}: {differ} values differ from the per-expert path's"
        else:
            assert_within_rounding(got, per_expert, scale, f"{tokens} tokens, top_k {top_k}")


def assert_near_reference(
    got: torch.Tensor,
    block: QuantizedExperts,
    w13: list[QuantizedWeight],
    w2: list[QuantizedWeight],
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> float:
    """`got`, the block's output for `x`, against the dequantized reference in the bound of x's
    dtype, with zeros for the tokens routed only to other ranks; returns the output's scale."""
    assert got.dtype == x.dtype and got.shape == x.shape
    want = reference(w13, w2, x, weights, ids, block)
    scale = want.abs().max().item() + 1e-6
    error = (got.float() - want).abs().max().item() / scale
    assert error <= (1e-4 if x.dtype == torch.float32 else 2**-5), f"{error:.2e} of the output off the reference"
    skipped = (ids < 0).all(dim=1)
    assert bool((got[skipped] == 0).all()), "a token routed only to other ranks' experts is not zero"
    return scale


def assert_within_rounding(got: torch.Tensor, per_expert: torch.Tensor, scale: float, label: str) -> None:
    """`got` against the per-expert path's output in the rounding bound of the module doc."""
    bound = 1e-5 * scale if got.dtype == torch.float32 else 2**-7 * (per_expert.float().abs() + scale)
    excess = ((got.float() - per_expert.float()).abs() - bound).max().item()
    assert excess <= 0, f"{label}: {excess / scale:.2e} past the bound"


def test_the_experts_bytes_are_held_once() -> None:
    """Stacking re-points every expert's layer at its slice of the stacked tensor: no copy stays,
    and the per-expert layers still compute the same."""
    block, _, _ = make_experts(CASES[0], 3, False, torch.float32)
    before = [layer.q_packed.clone() for expert in block for layer in (expert.gate_up_proj, expert.down_proj)]
    stacked = block.stacked()
    assert stacked is not None
    after = [layer.q_packed for expert in block for layer in (expert.gate_up_proj, expert.down_proj)]
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        whole = (stacked.gate_up if i % 2 == 0 else stacked.down)["packed"]
        assert torch.equal(old, new)
        assert new.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_experts_that_differ_run_per_expert() -> None:
    """A block whose experts' packings differ (format or group) cannot be stacked: the per-expert
    path serves it, and says why."""
    block, _, _ = make_experts(CASES[0], 3, False, torch.float32)
    block[1].gate_up_proj = QuantLinear(weight("int8", 8, False, 80, 72, seed=9), None)
    x = torch.randn(4, 72)
    weights, ids = routing(4, 2, 3, seed=1)
    with structlog.testing.capture_logs() as logs:
        got = block(x, weights, ids)
    assert block.stacked() is None and not block.is_stacked
    assert [e["reason"] for e in logs if e["event"] == "moe.per_expert_kernels"] == [
        "the experts' packings differ within a projection (int4 in groups of 8 with offsets, int8 in groups of 8)"
    ], logs
    assert torch.equal(got, block.per_expert(x, weights, ids))


def test_float16_and_the_kernels_off_take_the_per_expert_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 x (the tile kernels take bfloat16 and float32) and ``SONAR_NATIVE_KERNELS=0``: the
    per-expert path, still the reference's result."""
    block, w13, w2 = make_experts(CASES[0], 3, False, torch.float16)
    weights, ids = routing(3, 2, 3, seed=2)
    x = torch.randn(3, 72).to(torch.float16)
    got = block(x, weights, ids)
    assert got.dtype == torch.float16 and torch.equal(got, block.per_expert(x, weights, ids))
    want = reference(w13, w2, x, weights, ids, block)
    assert (got.float() - want).abs().max() <= 2**-5 * want.abs().max()
    monkeypatch.setenv(native.ENV, "0")
    assert block.stacked() is None
    x = x.float()
    assert torch.equal(block(x, weights, ids), block.per_expert(x, weights, ids))


def test_bad_ids_are_refused() -> None:
    block, _, _ = make_experts(CASES[0], 3, False, torch.float32)
    x = torch.randn(2, 72)
    weights, ids = routing(2, 2, 3, seed=4)
    ids[1, 0] = 3
    with pytest.raises(RuntimeError, match="expert id 3 outside"):
        block(x, weights, ids)


PORTABLE_CHECK = """
import sys
import torch
torch.ops.load_library(sys.argv[1])
from sonar.kernels import quant, quant_cpu
from sonar.kernels.moe import fused_experts_reference
from tests.kernels.test_moe_quant import CASES, LIMIT, ALPHA, routing, weight

torch.ops.sonar_cpu.set_quant_isa("portable")
for fmt13, fmt2, group, offsets, h, inter in CASES:
    w13 = [weight(fmt13, group, offsets, 2 * inter, h, seed=2 * e) for e in range(4)]
    w2 = [weight(fmt2, group, offsets, h, inter, seed=2 * e + 1) for e in range(4)]
    gen = torch.Generator().manual_seed(1)
    b13, b2 = torch.randn(4, 2 * inter, generator=gen), torch.randn(4, h, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(7, h, generator=gen).to(dtype)
        weights, ids = routing(7, 2, 4, seed=5)
        got = torch.ops.sonar_cpu.moe_quant(
            x, weights, ids, torch.stack([quant_cpu.pack(w) for w in w13]), quant_cpu.FORMAT_CODES[fmt13], group,
            offsets, torch.stack([quant_cpu.pack(w) for w in w2]), quant_cpu.FORMAT_CODES[fmt2], group, offsets,
            b13, b2, LIMIT, ALPHA,
        )
        want = fused_experts_reference(
            x.float(), weights, ids, torch.stack([quant.dequantize(w) for w in w13]),
            torch.stack([quant.dequantize(w) for w in w2]), b13, b2, LIMIT, ALPHA,
        )
        error = (got.float() - want).abs().max() / want.abs().max()
        assert error <= (1e-4 if dtype == torch.float32 else 2**-5), (fmt13, dtype, float(error))
print("ok")
"""


def test_portable_build_runs_the_grouped_operator(portable_library: Path) -> None:
    """The kernels as a CPU without AVX-512 gets them (``-mno-avx512f``), the portable loop forced,
    in a fresh process (one process loads one ``sonar_cpu`` library): every case against the
    dequantized reference, with GPT-OSS's biases (float32, x bfloat16 too) and clamped SwiGLU."""
    assert_portable_check_passes(PORTABLE_CHECK, portable_library)
