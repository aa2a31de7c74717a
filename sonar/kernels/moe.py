"""The fused mixture-of-experts operator: top-k routing, then one grouped computation over the
tokens each expert was routed to.

A sparse MoE layer sends each of ``n`` tokens to ``top_k`` of ``E`` experts, each a gated SiLU
MLP. The experts' weights are stacked: ``w13`` ``[E, 2 * I, h]`` (each expert's gate rows, then
its up rows) and ``w2`` ``[E, h, I]``. For a token ``x`` routed to experts ``e_j`` with weights
``p_j``::

    out = sum_j p_j * w2[e_j] @ (silu(w13[e_j][:I] @ x) * (w13[e_j][I:] @ x))

GPT-OSS's experts (`swiglu_limit` set) add biases (``b13`` ``[E, 2 I]`` after the first GEMM,
``b2`` ``[E, h]`` after the second, before the routing weight) and replace silu-and-mul with the
clamped SwiGLU `reference.clamped_swiglu` (gate clamped above, up clamped both sides at the
limit, ``(up + 1) * gate * sigmoid(alpha * gate)``); every path below serves both.

`route` picks the experts as Mixtral and Qwen-MoE do: a float32 softmax over the router logits,
the ``top_k`` largest probabilities, divided by their sum when `renormalize` (Mixtral always;
Qwen-MoE by ``norm_topk_prob``). The routing weights stay float32.

DeepSeek-V2 and V3 route by groups of experts (`route_group_limited`, `route_noaux_tc`) and
feed the same `fused_experts`.

`fused_experts` runs the experts, never as a Python loop over them:

* CPU, the native kernel (``torch.ops.sonar_cpu.fused_moe``, ``csrc/cpu_ops.cpp``): counting-sorts
  the (token, expert) pairs by expert, runs each expert's two GEMMs over its gathered rows, and
  sums each token's weighted rows in float32 (in expert order, as the reference does);
* CUDA, the Triton grouped GEMM (`sonar.kernels.triton.fused_moe`): the pairs sorted by expert
  and padded to the GEMM's row block, one launch per projection whatever the mix of experts, no
  host sync (CUDA graphs capture it); quantized experts (`sonar.models.moe.QuantizedExperts`) call
  it with their stacked packings;
* elsewhere `fused_experts_reference`, a per-expert loop that states the contract: each expert's
  activations in the input dtype (silu-and-mul rounded as the model's MLP rounds it), the
  weighted sum over a token's experts accumulated in float32 and rounded once.

Expert parallelism (`sonar.models.moe`): a rank holds some of the experts, stacked in ``w13`` /
``w2`` by a local index, and maps the router's global ids to local ones, ``-1`` for the experts
other ranks hold (`TensorParallel.local_expert_ids`). Every path skips the pairs of id ``-1``
(they add zero), so the ranks' outputs sum to the whole layer's.

Under ``torch.compile`` the operator is ``torch.ops.sonar.fused_experts``, opaque to Inductor (its
fake allocates the output), which dispatches as above when it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sonar.kernels import ops, reference


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """``router_logits`` ``[n, E]`` -> (weights float32 ``[n, top_k]``, expert ids int64 ``[n, top_k]``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_group_limited(router_logits: Tensor, top_k: int, num_groups: int, top_groups: int) -> tuple[Tensor, Tensor]:
    """DeepSeek-V2's routing (``topk_method`` ``group_limited_greedy``; ``greedy`` is one group):
    a float32 softmax over all ``E`` experts, the experts cut into `num_groups` equal groups, each
    group scored by its best probability, the probabilities outside the `top_groups` best groups
    zeroed, then the ``top_k`` largest. The weights are the softmax probabilities themselves (not
    renormalized; the caller applies ``routed_scaling_factor``)."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    if num_groups > 1:
        grouped = scores.view(scores.shape[0], num_groups, -1)
        best = torch.topk(grouped.amax(dim=-1), top_groups, dim=-1)[1]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(scores)
    return torch.topk(scores, top_k, dim=-1)


def route_noaux_tc(
    router_logits: Tensor,
    top_k: int,
    num_groups: int,
    top_groups: int,
    correction_bias: Tensor,
    renormalize: bool,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3's routing (``topk_method`` ``noaux_tc``): float32 sigmoid scores; the choice is
    made on the scores plus `correction_bias` (``e_score_correction_bias``, the auxiliary-loss-free
    balancing term), each of `num_groups` groups scored by the sum of its two best, the experts
    outside the `top_groups` best groups left out, then the ``top_k`` largest. The weights are the
    chosen experts' *uncorrected* scores, divided by their sum (plus 1e-20) when `renormalize`."""
    scores = torch.sigmoid(router_logits.float())
    choice = scores + correction_bias.float()
    grouped = choice.view(choice.shape[0], num_groups, -1)
    best = torch.topk(torch.topk(grouped, 2, dim=-1)[0].sum(dim=-1), top_groups, dim=-1)[1]
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, ids


def route_topk_softmax(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """GPT-OSS's routing: the ``top_k`` largest logits, then a softmax over those alone (in the
    logits' dtype, as transformers computes it), returned as float32 weights and int64 ids."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype).float(), ids


def check_shapes(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
) -> None:
    n, h = x.shape
    experts, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (experts, h, two_i // 2):
        raise ValueError(
            f"expert weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want [E, 2 I, {h}]), "
            f"w2 {tuple(w2.shape)} (want [E, {h}, I])"
        )
    if weights.shape != ids.shape or weights.dim() != 2 or weights.shape[0] != n:
        raise ValueError(f"routing does not fit {n} tokens: weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if (b13 is not None and tuple(b13.shape) != (experts, two_i)) or (
        b2 is not None and tuple(b2.shape) != (experts, h)
    ):
        raise ValueError(
            f"expert biases do not fit: b13 {None if b13 is None else tuple(b13.shape)} (want [E, {two_i}]), "
            f"b2 {None if b2 is None else tuple(b2.shape)} (want [E, {h}])"
        )


def activation(gate_up: Tensor, swiglu_limit: float | None, swiglu_alpha: float) -> Tensor:
    """An expert's activation of its ``[rows, 2 I]`` gate/up product: silu-and-mul, or with a
    `swiglu_limit` GPT-OSS's clamped SwiGLU."""
    if swiglu_limit is None:
        return reference.silu_and_mul(gate_up)
    return reference.clamped_swiglu(gate_up, swiglu_limit, swiglu_alpha)


def fused_experts_reference(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> Tensor:
    """The contract of every path, one expert at a time (see the module docstring); biases are
    added after each product (``x @ W + b``, as transformers' GPT-OSS experts compute it)."""
    check_shapes(x, weights, ids, w13, w2, b13, b2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = F.linear(x[token], w13[e])
        if b13 is not None:
            gate_up = gate_up + b13[e]
        y = F.linear(activation(gate_up, swiglu_limit, swiglu_alpha), w2[e])
        if b2 is not None:
            y = y + b2[e]
        out.index_add_(0, token, y.float() * weights[token, slot, None].float())
    return out.to(x.dtype)


def _run(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None,
    b2: Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float,
) -> Tensor:
    extra = [t for t in (b13, b2) if t is not None]
    if ops.use_triton(x, w13, w2, *extra):
        from sonar.kernels.triton import fused_moe

        return fused_moe.fused_experts(x, weights, ids, w13, w2, b13, b2, swiglu_limit, swiglu_alpha)
    if ops.use_native(x, w13, w2, *extra) and all(t.is_contiguous() for t in (x, w13, w2, *extra)):
        return torch.ops.sonar_cpu.fused_moe(
            x, weights.float().contiguous(), ids.long().contiguous(), w13, w2, b13, b2, swiglu_limit, swiglu_alpha
        )
    return fused_experts_reference(x, weights, ids, w13, w2, b13, b2, swiglu_limit, swiglu_alpha)


@torch.library.custom_op("sonar::fused_experts", mutates_args=())
def fused_experts_op(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None,
    b2: Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float,
) -> Tensor:
    """`fused_experts` as one opaque operator for compiled graphs."""
    return _run(x, weights, ids, w13, w2, b13, b2, swiglu_limit, swiglu_alpha).contiguous()


@fused_experts_op.register_fake
def _fused_experts_fake(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None,
    b2: Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float,
) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fused_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    b13: Tensor | None = None,
    b2: Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> Tensor:
    """``x`` ``[n, h]`` through the experts `ids` ``[n, top_k]`` chose (-1: skipped), weighted by
    `weights` ``[n, top_k]``; ``w13`` ``[E, 2 I, h]``, ``w2`` ``[E, h, I]`` (and the biases ``b13``
    ``[E, 2 I]``, ``b2`` ``[E, h]`` where given) in ``x``'s dtype; a `swiglu_limit` selects
    GPT-OSS's clamped SwiGLU. Returns ``[n, h]``."""
    check_shapes(x, weights, ids, w13, w2, b13, b2)
    if torch.compiler.is_compiling():
        return fused_experts_op(x, weights, ids, w13, w2, b13, b2, swiglu_limit, swiglu_alpha)
    return _run(x, weights, ids, w13, w2, b13, b2, swiglu_limit, swiglu_alpha)


def fused_moe(x: Tensor, router_logits: Tensor, top_k: int, renormalize: bool, w13: Tensor, w2: Tensor) -> Tensor:
    """A sparse MoE layer's experts: `route` then `fused_experts`."""
    weights, ids = route(router_logits, top_k, renormalize)
    return fused_experts(x, weights, ids, w13, w2)
