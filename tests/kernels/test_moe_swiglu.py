"""The fused MoE operator's GPT-OSS option (`sonar.kernels.moe`: expert biases and the clamped
SwiGLU, selected by ``swiglu_limit``): GPT-OSS's routing (top-k of the logits, then a softmax over
those) and the per-expert reference against transformers' own ``GptOssTopKRouter`` /
``GptOssExperts`` (stacked, transposed, interleaved layout), then the native CPU kernel and the
Triton grouped GEMM (interpreted) against the reference. Gate/up values are made large enough
that the clamps bite; each case checks that they do."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import moe, native, reference
from sonar.kernels.triton import fused_moe as triton_moe

LIMIT, ALPHA = 7.0, 1.702


def _case(n: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0, h: int = 48, inter: int = 40):
    """Weights scaled so gate/up products reach past the limit (the clamps matter)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype)
    logits = torch.randn(n, experts, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, h, generator=gen) * 4 / h**0.5).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    w2 = (torch.randn(experts, h, inter, generator=gen) / inter**0.5).to(dtype)
    b2 = torch.randn(experts, h, generator=gen).to(dtype)
    weights, ids = moe.route_topk_softmax(logits, top_k)
    return x, weights, ids, w13, w2, b13, b2


CASES = {
    "mixed": lambda dtype: _case(13, 6, 2, dtype),
    "one_token": lambda dtype: _case(1, 4, 2, dtype, seed=1),
    "top_k_is_E": lambda dtype: _case(7, 4, 4, dtype, seed=2),
    "many_tokens": lambda dtype: _case(70, 8, 2, dtype, seed=3),
}


def _want(x, weights, ids, w13, w2, b13, b2) -> torch.Tensor:
    return moe.fused_experts_reference(x, weights, ids, w13, w2, b13, b2, LIMIT, ALPHA)


def _check(got: torch.Tensor, args: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    """float32: the reference's values to 1e-5. bfloat16: the float32 reference on the same
    (rounded) inputs, within 1% of the output's largest magnitude (outputs reach tens, where a
    bfloat16 ulp is 0.125-0.25; the kernels round gate/up and the activation at other points
    than the reference's op-by-op bfloat16)."""
    assert got.dtype == dtype and got.shape == args[0].shape
    want = _want(*(t if t.dtype == torch.int64 else t.float() for t in args))
    atol = 1e-5 if dtype == torch.float32 else 1e-2 * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=1e-5 if dtype == torch.float32 else 2e-2)


def test_clamps_bite() -> None:
    x, _, _, w13, _, b13, _ = _case(13, 6, 2, torch.float32)
    gate_up = torch.nn.functional.linear(x, w13[0]) + b13[0]
    assert gate_up.abs().max() > 2 * LIMIT
    plain = reference.clamped_swiglu(gate_up, float("inf"), ALPHA)
    assert (reference.clamped_swiglu(gate_up, LIMIT, ALPHA) - plain).abs().max() > 1.0


def test_routing_is_transformers() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 16, generator=gen)
    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.bias.copy_(torch.randn(router.bias.shape, generator=gen))
        logits, want_weights, want_ids = router(x)
    weights, ids = moe.route_topk_softmax(logits, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=0)


def test_reference_is_transformers_experts() -> None:
    """transformers keeps ``gate_up_proj`` ``[E, h, 2 I]`` with gate and up in alternating
    columns and ``down_proj`` ``[E, I, h]``: de-interleaved and transposed, they are ``w13`` / ``w2``."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x, weights, ids, w13, w2, b13, b2 = _case(10, 6, 2, torch.float32)
    inter = w2.shape[2]
    config = GptOssConfig(hidden_size=48, intermediate_size=inter, num_local_experts=6)
    experts = GptOssExperts(config)
    interleaved = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(6, 2 * inter, 48)
    with torch.no_grad():
        experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack([b13[:, :inter], b13[:, inter:]], dim=2).reshape(6, 2 * inter))
        experts.down_proj.copy_(w2.transpose(1, 2))
        experts.down_proj_bias.copy_(b2)
        want = experts(x, ids, weights)
    torch.testing.assert_close(_want(x, weights, ids, w13, w2, b13, b2), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_native_matches_reference(case: str, dtype: torch.dtype) -> None:
    assert native.available(), "the native kernels did not build"
    args = CASES[case](dtype)
    _check(torch.ops.sonar_cpu.fused_moe(*args, LIMIT, ALPHA), args, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case: str, dtype: torch.dtype) -> None:
    args = CASES[case](dtype)
    _check(triton_moe.fused_experts(*args, LIMIT, ALPHA), args, dtype)


def test_dispatch_and_the_compiled_operator_carry_the_option() -> None:
    args = CASES["mixed"](torch.float32)
    want = _want(*args)
    torch.testing.assert_close(moe.fused_experts(*args, LIMIT, ALPHA), want, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(moe.fused_experts, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args, LIMIT, ALPHA), want, atol=1e-5, rtol=1e-5)
    plain = moe.fused_experts(*args[:5])
    assert (plain - want).abs().max() > 0.1


def test_biases_that_do_not_fit_are_refused() -> None:
    x, weights, ids, w13, w2, b13, b2 = CASES["mixed"](torch.float32)
    with pytest.raises(ValueError, match="expert biases do not fit"):
        moe.fused_experts(x, weights, ids, w13, w2, b13[:, :-1], b2)
    with pytest.raises(RuntimeError, match="b2"):
        torch.ops.sonar_cpu.fused_moe(x, weights, ids, w13, w2, b13, b2[:, :-1])
