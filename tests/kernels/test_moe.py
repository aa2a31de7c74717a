"""The fused MoE operator (`sonar.kernels.moe`): routing and the per-expert reference against
transformers' own Mixtral / Qwen-MoE modules, then the native CPU kernel and the Triton grouped
GEMM (interpreted) against the reference, edge cases included: an expert no token chose, one
token, top-k = E, no tokens at all."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import moe, native
from sonar.kernels.triton import fused_moe as triton_moe

#: float32: the same products summed in another order (native) or by another GEMM (Triton);
#: bfloat16: an ulp or two of the rounded activations (values O(1)).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _case(n: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0, h: int = 48, inter: int = 40):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    logits = torch.randn(n, experts, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = moe.route(logits, top_k, renormalize=seed % 2 == 0)
    return x, weights, ids, w13, w2


def _unused_expert(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Nine tokens routed over experts 0, 1, 3 of five: 2 and 4 get none."""
    x, weights, _, w13, w2 = _case(9, 5, 2, dtype, seed=4)
    ids = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [3, 1], [1, 0], [0, 1], [3, 0], [1, 3]])
    return x, weights, ids, w13, w2


CASES = {
    "mixed": lambda dtype: _case(13, 6, 2, dtype),
    "one_token": lambda dtype: _case(1, 4, 2, dtype, seed=1),
    "top_k_is_E": lambda dtype: _case(7, 4, 4, dtype, seed=2),
    "many_tokens": lambda dtype: _case(70, 8, 2, dtype, seed=3),
    "unused_experts": _unused_expert,
    "no_tokens": lambda dtype: _case(0, 4, 2, dtype),
}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_transformers(renormalize: bool) -> None:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=gen)
    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    else:
        config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
        router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        logits, want_weights, want_ids = router(x)
    weights, ids = moe.route(logits, want_ids.shape[1], renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=0)


def test_reference_is_transformers_experts() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    x, weights, ids, w13, w2 = _case(10, 6, 2, torch.float32)
    experts = MixtralExperts(MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6))
    with torch.no_grad():
        experts.gate_up_proj.copy_(w13)
        experts.down_proj.copy_(w2)
        want = experts(x, ids, weights)
    torch.testing.assert_close(moe.fused_experts_reference(x, weights, ids, w13, w2), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_native_matches_reference(case: str, dtype: torch.dtype) -> None:
    assert native.available(), "the native kernels did not build"
    x, weights, ids, w13, w2 = CASES[case](dtype)
    got = torch.ops.sonar_cpu.fused_moe(x, weights, ids, w13, w2)
    close(got, moe.fused_experts_reference(x, weights, ids, w13, w2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case: str, dtype: torch.dtype) -> None:
    x, weights, ids, w13, w2 = CASES[case](dtype)
    got = triton_moe.fused_experts(x, weights, ids, w13, w2)
    close(got, moe.fused_experts_reference(x, weights, ids, w13, w2), dtype)


def test_dispatch_on_the_cpu_takes_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weights, ids, w13, w2 = _case(5, 4, 2, torch.float32)
    logits = torch.randn(5, 4)
    got = moe.fused_moe(x, logits, 2, True, w13, w2)
    weights, ids = moe.route(logits, 2, True)
    assert torch.equal(got, torch.ops.sonar_cpu.fused_moe(x, weights, ids, w13, w2))
    monkeypatch.setenv("SONAR_NATIVE_KERNELS", "0")
    assert torch.equal(
        moe.fused_moe(x, logits, 2, True, w13, w2), moe.fused_experts_reference(x, weights, ids, w13, w2)
    )


def test_aligned_blocks_each_hold_one_experts_pairs() -> None:
    _, _, ids, _, _ = _unused_expert(torch.float32)
    block = 4
    sorted_ids, expert_ids, total = triton_moe.align_block_size(ids, 5, block)
    pairs = ids.numel()
    total = int(total)
    assert total % block == 0 and sorted_ids.numel() == pairs + 5 * (block - 1)
    assert (sorted_ids[total:] == pairs).all()
    real = sorted_ids[:total][sorted_ids[:total] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    flat = ids.reshape(-1)
    for b in range(total // block):
        rows = sorted_ids[b * block : (b + 1) * block]
        rows = rows[rows < pairs]
        assert rows.numel() and (flat[rows] == expert_ids[b]).all()
        assert torch.equal(rows, rows.sort().values)  # one expert's pairs in token order


def test_compiled_graphs_call_one_opaque_operator() -> None:
    x, weights, ids, w13, w2 = _case(6, 4, 2, torch.float32)
    compiled = torch.compile(moe.fused_experts, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, weights, ids, w13, w2), moe.fused_experts(x, weights, ids, w13, w2))


def test_shapes_that_do_not_fit_are_refused() -> None:
    x, weights, ids, w13, w2 = _case(3, 4, 2, torch.float32)
    with pytest.raises(ValueError, match="expert weights do not fit"):
        moe.fused_experts(x, weights, ids, w13, w2[:, :, :-1])
    with pytest.raises(RuntimeError, match="expert id 7 outside"):
        torch.ops.sonar_cpu.fused_moe(x, weights, torch.full_like(ids, 7), w13, w2)
