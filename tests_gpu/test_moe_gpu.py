"""The fused MoE experts compiled for the GPU (`sonar/kernels/triton/fused_moe.py`) at Qwen3-MoE- and
Mixtral-shaped layers against the per-expert reference, and captured in a CUDA graph (the routing
changes between replays; the launch grid does not)."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import moe
from sonar.kernels.triton import fused_moe
from sonar.models.parallel import TensorParallel

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
