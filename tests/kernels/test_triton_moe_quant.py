"""Quantized experts on the Triton grouped GEMM: `QuantizedExperts` whose layers the CUDA backend
(`sonar.kernels.quant_triton.TritonBackend`) packed, run on CPU tensors by Triton's interpreter.
The block stacks the packings and one `sonar.kernels.triton.fused_moe.fused_experts` call per
block reads the packed values and scales; it is checked against the per-expert path (each active
expert's rows through its own `quant_matmul` calls, `QuantizedExperts.per_expert`) and the
dequantized `fused_experts_reference`: int4 with offsets, int8, fp8, a mixed block, mxfp4, with
and without GPT-OSS's biases and clamped SwiGLU, -1 ids (another rank's experts), an expert no
token chose, top_k 1 and 2, both row blocks (16 and 64), bfloat16 and float32 x.

Tolerances, as a fraction of the output's largest magnitude (``scale``):

* per-expert path, float32 x: 1e-5 (float32 summation order; both apply a group's scale to a K
  tile's sum).
* per-expert path, bfloat16 x: 2^-7 of each value plus 2^-7 of ``scale``. Both round the first
  product and the activation to bfloat16 at the same points; the per-expert path also rounds each
  expert's second product to bfloat16 before the routing weight, where the grouped one keeps it in
  float32 (one bfloat16 step, 2^-8, per term).
* dequantized reference in float32: float32 x 1e-4, bfloat16 x 2^-5 of ``scale``.
"""

from __future__ import annotations

import pytest
import torch

from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantLinear
from sonar.kernels.quant_triton import TritonBackend
from sonar.models.moe import QuantizedExperts
from tests.kernels.test_moe_quant import assert_near_reference, assert_within_rounding, make_experts, routing

# (gate_up format, down format, group, offsets, h, I): groups the Triton kernel serves (multiples
# of 16 dividing K)
CASES = [
    ("int4", "int4", 32, True, 64, 32),
    ("int8", "int8", 16, False, 64, 32),
    ("fp8", "fp8", 32, False, 64, 32),
    ("int4", "int8", 16, True, 64, 48),
    ("mxfp4", "mxfp4", 32, False, 64, 32),
]
EXPERTS = 5


def triton_experts(
    case: tuple[str, str, int, bool, int, int], gpt_oss: bool, dtype: torch.dtype
) -> tuple[QuantizedExperts, list[QuantizedWeight], list[QuantizedWeight]]:
    """`make_experts`' block and weights, its layers packed by the CUDA backend instead."""
    block, w13, w2 = make_experts(case, EXPERTS, gpt_oss, dtype)
    backend = TritonBackend()
    for expert, gate_up, down in zip(block, w13, w2, strict=True):
        expert.gate_up_proj = QuantLinear(gate_up, None, backend=backend)
        expert.down_proj = QuantLinear(down, None, backend=backend)
    return block, w13, w2


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-g{c[2]}{'-offsets' if c[3] else ''}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
def test_grouped_equals_per_expert_and_reference(
    case: tuple[str, str, int, bool, int, int], dtype: torch.dtype, gpt_oss: bool
) -> None:
    block, w13, w2 = triton_experts(case, gpt_oss, dtype)
    gen = torch.Generator().manual_seed(3)
    # 45 tokens of top_k 2: 90 pairs, past 16 per expert, the 64-row blocks
    for tokens, top_k in ((1, 1), (1, 2), (6, 2), (45, 2)):
        x = torch.randn(tokens, case[4], generator=gen).to(dtype)
        weights, ids = routing(tokens, top_k, EXPERTS, seed=tokens + top_k)
        got = block(x, weights, ids)
        stacked = block.stacked()
        assert stacked is not None and stacked.backend == "triton", "the grouped Triton path did not run"
        scale = assert_near_reference(got, block, w13, w2, x, weights, ids)
        assert_within_rounding(got, block.per_expert(x, weights, ids), scale, f"{tokens} tokens, top_k {top_k}")


def test_the_stacked_packings_are_the_layers_bytes() -> None:
    """Stacking re-points each expert's packed tensors at its slice of the stacked ones: the bytes
    are held once (MXFP4's exponent bytes too: 17 bytes per 32 weights) and the layers still
    compute the same."""
    block, w13, w2 = triton_experts(CASES[-1], False, torch.float32)
    x = torch.randn(3, CASES[-1][4])
    weights, ids = routing(3, 2, EXPERTS, seed=4)
    before = block.per_expert(x, weights, ids)
    stacked = block.stacked()
    assert stacked is not None and set(stacked.gate_up) == set(stacked.down) == {"qweight", "exponents"}
    assert stacked.nbytes == sum(w.nbytes for w in w13 + w2)
    for e, expert in enumerate(block):
        for layer, whole in ((expert.gate_up_proj, stacked.gate_up), (expert.down_proj, stacked.down)):
            for name, tensor in layer.packed.items():
                assert torch.equal(tensor, whole[name][e])
                assert tensor.untyped_storage().data_ptr() == whole[name].untyped_storage().data_ptr()
    assert torch.equal(block.per_expert(x, weights, ids), before)


def test_act_order_experts_run_per_expert() -> None:
    """GPTQ act-order permutes each expert's input columns: no grouped kernel reads that, so the
    per-expert path serves the block."""
    block, w13, _ = triton_experts(CASES[0], False, torch.float32)
    for expert, qw in zip(block, w13, strict=True):
        order = torch.randperm(qw.in_features, generator=torch.Generator().manual_seed(5))
        permuted = QuantizedWeight(qw.format, qw.values, qw.scales, qw.offsets, qw.group, order)
        expert.gate_up_proj = QuantLinear(permuted, None, backend=TritonBackend())
    x = torch.randn(4, CASES[0][4])
    weights, ids = routing(4, 2, EXPERTS, seed=6)
    assert torch.equal(block(x, weights, ids), block.per_expert(x, weights, ids))
    assert block.stacked() is None and not block.is_stacked
