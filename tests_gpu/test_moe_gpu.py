"""The fused MoE experts compiled for the GPU (`sonar/kernels/triton/fused_moe.py`) at Qwen3-MoE- and
Mixtral-shaped layers against the per-expert reference, and captured in a CUDA graph (the routing
changes between replays; the launch grid does not); quantized experts (`QuantizedExperts` on the
Triton backend: int4 with offsets, MXFP4) through the same grouped GEMM over their packed values."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import moe, quant
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantLinear
from sonar.kernels.triton import fused_moe
from sonar.models.moe import QuantizedExperts
from sonar.models.parallel import TensorParallel
from tests.kernels.test_moe_quant import reference

#: bfloat16 GEMMs accumulated in float32 in both; rows rounded at different points (values O(1)).
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}
SHAPES = {  # tokens, hidden, experts, intermediate, top-k
    "qwen3_moe_decode": (8, 2048, 128, 768, 8),
    "qwen3_moe_prefill": (512, 2048, 128, 768, 8),
    "mixtral_prefill": (300, 1024, 8, 3584, 2),
}


def _case(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    n, h, experts, inter, top_k = shape
    x = torch.randn(n, h, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda") / h**0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, device="cuda") / inter**0.5).to(dtype)
    weights, ids = moe.route(torch.randn(n, experts, device="cuda"), top_k, renormalize=True)
    return x, weights, ids, w13, w2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_experts_match_the_reference(shape: str, dtype: torch.dtype) -> None:
    x, weights, ids, w13, w2 = _case(SHAPES[shape], dtype)
    got = moe.fused_experts(x, weights, ids, w13, w2)  # dispatches to Triton for CUDA tensors
    want = moe.fused_experts_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_cuda_graph_replays_new_routing() -> None:
    x, weights, ids, w13, w2 = _case(SHAPES["qwen3_moe_decode"], torch.bfloat16)
    fused_moe.fused_experts(x, weights, ids, w13, w2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_experts(x, weights, ids, w13, w2)
    new_weights, new_ids = moe.route(torch.randn(ids.shape[0], w13.shape[0], device="cuda"), ids.shape[1], True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = moe.fused_experts_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_parallel_ranks_sum_to_the_whole_layer_in_a_cuda_graph(placement: str) -> None:
    """Four expert-parallel ranks' local experts (the others' ids -1, mapped inside the capture):
    their outputs sum to the whole layer's, and replays follow new routing."""
    x, weights, ids, w13, w2 = _case(SHAPES["qwen3_moe_decode"], torch.bfloat16)
    experts = w13.shape[0]
    ranks = [TensorParallel(r, 4, expert_placement=placement) for r in range(4)]
    local = [(tp, tp.local_experts(experts)) for tp in ranks]
    stacked = [(w13[experts_].contiguous(), w2[experts_].contiguous()) for _, experts_ in local]

    def run() -> list[torch.Tensor]:
        return [
            fused_moe.fused_experts(x, weights, tp.local_expert_ids(ids, experts), a, b)
            for (tp, _), (a, b) in zip(local, stacked)
        ]

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    new_weights, new_ids = moe.route(torch.randn(ids.shape[0], experts, device="cuda"), ids.shape[1], True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    total = sum(out.float() for out in outs)
    want = moe.fused_experts_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(total, want.float(), atol=6e-2, rtol=3e-2)


def test_eplb_replicas_sum_to_the_whole_layer_in_a_cuda_graph() -> None:
    """Expert load balancing's maps (`sonar.models.eplb.ExpertMap`) on four ranks with 8 replica
    slots, inside the capture: the ranks sum to the whole layer, each replay counts its routed
    pairs on the device, and a new placement written between replays (maps and stacked weights in
    place, as a rebalance does) is what the next replay computes."""
    from sonar.core import eplb
    from sonar.models.eplb import ExpertMap

    x, weights, ids, w13, w2 = _case(SHAPES["qwen3_moe_decode"], torch.bfloat16)
    experts, slots = w13.shape[0], w13.shape[0] + 8
    maps = [ExpertMap(experts, slots, TensorParallel(r, 4, expert_placement="linear")).cuda() for r in range(4)]
    stacked = [(w13[m.local_experts].contiguous(), w2[m.local_experts].contiguous()) for m in maps]

    def run() -> list[torch.Tensor]:
        return [fused_moe.fused_experts(x, weights, m.local_ids(ids), a, b) for m, (a, b) in zip(maps, stacked)]

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for m in maps:
        m.load.zero_()
    load = torch.randint(0, 1000, (experts,)).tolist()
    placement = eplb.rebalance(load, slots, 4, previous=maps[0].placement)
    for m, (a, b) in zip(maps, stacked):
        m.set_placement(placement)
        a.copy_(w13[m.local_experts])
        b.copy_(w2[m.local_experts])
    new_weights, new_ids = moe.route(torch.randn(ids.shape[0], experts, device="cuda"), ids.shape[1], True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    total = sum(out.float() for out in outs)
    want = moe.fused_experts_reference(x, weights, ids, w13, w2)
    torch.testing.assert_close(total, want.float(), atol=6e-2, rtol=3e-2)
    counted = torch.bincount(ids.reshape(-1), minlength=experts)
    assert all(torch.equal(m.load, counted) for m in maps)


# --- quantized experts: the grouped GEMM over the packed values ---------------------------------------

#: format, tokens, hidden, experts, intermediate, top-k, GPT-OSS's biases and clamped SwiGLU: GGUF's
#: Q4_1 / Q4_K layout (int4 in groups of 32 with offsets) at Qwen3-30B-A3B's shapes, MXFP4 at gpt-oss-20b's
QUANTIZED = {
    "qwen3_moe_int4_decode": ("int4", 8, 2048, 128, 768, 8, False),
    "qwen3_moe_int4_prefill": ("int4", 300, 2048, 128, 768, 8, False),
    "gpt_oss_mxfp4_decode": ("mxfp4", 8, 2880, 32, 2880, 4, True),
}


def _quantized_weight(fmt: str, n: int, k: int) -> QuantizedWeight:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    if fmt == "mxfp4":
        exponents = torch.randint(118, 124, (n, k // 32), device="cuda")
        return QuantizedWeight("mxfp4", codes, quant.mxfp4_scales(exponents), None, 32)
    scales = (0.5 + torch.rand(n, k // 32, device="cuda")) / (4 * k**0.5)
    return QuantizedWeight("int4", codes, scales, -7.5 * scales, 32)


def _quantized_case(name: str) -> tuple[QuantizedExperts, list[QuantizedWeight], list[QuantizedWeight], tuple]:
    fmt, n, h, experts, inter, top_k, gpt_oss = QUANTIZED[name]
    block = QuantizedExperts(
        experts,
        h,
        inter,
        swiglu_limit=7.0 if gpt_oss else None,
        bias_device=torch.device("cuda"),
        bias_dtype=torch.bfloat16,
    )
    w13 = [_quantized_weight(fmt, 2 * inter, h) for _ in range(experts)]
    w2 = [_quantized_weight(fmt, h, inter) for _ in range(experts)]
    for expert, gate_up, down in zip(block, w13, w2, strict=True):
        expert.gate_up_proj, expert.down_proj = QuantLinear(gate_up, None), QuantLinear(down, None)
        assert expert.gate_up_proj.backend.name == "triton"
    if gpt_oss:
        block.gate_up_proj_bias.data.copy_(torch.randn(experts, 2 * inter, device="cuda") / 8)
        block.down_proj_bias.data.copy_(torch.randn(experts, h, device="cuda") / 8)
    x = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    weights, ids = moe.route(torch.randn(n, experts, device="cuda"), top_k, True)
    return block, w13, w2, (x, weights, ids)


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_experts_run_grouped_and_match_the_reference(name: str) -> None:
    """The block stacks its Triton packings and runs as two grouped launches: within 2^-5 of the
    output's scale of the dequantized float32 reference and of the per-expert path (bfloat16
    intermediates on both sides)."""
    block, w13, w2, (x, weights, ids) = _quantized_case(name)
    got = block(x, weights, ids)
    stacked = block.stacked()
    assert stacked is not None and stacked.backend == "triton"
    want = reference(w13, w2, x, weights, ids, block)
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2**-5 * scale
    assert (got.float() - block.per_expert(x, weights, ids).float()).abs().max().item() <= 2**-5 * scale


def test_quantized_experts_in_a_cuda_graph_replay_new_routing() -> None:
    """No host sync on the grouped path: the block is captured once and follows new routing."""
    block, w13, w2, (x, weights, ids) = _quantized_case("qwen3_moe_int4_decode")
    block(x, weights, ids)  # stacks the packings and compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x, weights, ids)
    new_weights, new_ids = moe.route(torch.randn(ids.shape[0], len(w13), device="cuda"), ids.shape[1], True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = reference(w13, w2, x, weights, ids, block)
    assert (out.float() - want).abs().max().item() <= 2**-5 * want.abs().max().item()
