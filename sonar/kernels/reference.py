"""Torch references for the Triton and native kernels (the path when neither applies).

Attention and the plain KV-cache write have their references in :mod:`sonar.kernels.attention`
(the layouts are documented there); this module adds what the kernels do beyond them: an FP8
(e4m3) KV cache with per-tensor or per-head scales, RMSNorm with a fused residual add, the
halves-layout rotary embedding (the native CPU kernel's contract; on CUDA Inductor fuses it),
SiLU-and-mul, GELU(tanh)-and-mul, GPT-OSS's clamped SwiGLU, the block copy between cache tensors and the batched LoRA add. Each function states the
contract its kernel follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sonar.kernels import attention

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


# --- FP8 KV cache -------------------------------------------------------------------------------


def _scale_for(x: Tensor, scale: Tensor) -> Tensor:
    """A scale of shape ``[1]`` (per tensor) or ``[num_kv_heads]`` (per head), broadcast against
    ``x`` ``[..., num_kv_heads, head_dim]``."""
    if scale.numel() == 1:
        return scale.reshape(()).to(torch.float32)
    return scale.to(torch.float32)[:, None]


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` rounded to float8 e4m3fn (to nearest, ties to even), saturating at +-448."""
    y = x.to(torch.float32) / _scale_for(x, scale)
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (x.to(torch.float32) * _scale_for(x, scale)).to(dtype)


def kv_scales(key: Tensor, value: Tensor, per_head: bool = False) -> tuple[Tensor, Tensor]:
    """Scales that map the largest ``|key|`` / ``|value|`` (``[num_tokens, num_kv_heads,
    head_dim]``) onto the e4m3 range: float32 ``[1]``, or ``[num_kv_heads]`` with ``per_head``."""

    def one(x: Tensor) -> Tensor:
        amax = x.abs().to(torch.float32).amax(dim=(0, 2)) if per_head else x.abs().max().to(torch.float32)[None]
        return (amax / FP8_E4M3_MAX).clamp_min(1e-12)

    return one(key), one(value)


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """:func:`sonar.kernels.attention.write_kv_cache`, plus: a float8 ``kv_cache`` stores
    :func:`quantize_fp8` of the keys and values with ``k_scale`` / ``v_scale``; negative slots
    (padding tokens) are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if kv_cache.dtype != FP8_DTYPE:
        attention.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    # index_copy_ has no float8 kernel on CPU: copy the bytes
    attention.write_kv_cache(
        quantize_fp8(key, k_scale).view(torch.uint8),
        quantize_fp8(value, v_scale).view(torch.uint8),
        kv_cache.view(torch.uint8),
        slot_mapping,
    )


def dequantize_kv_cache(kv_cache: Tensor, k_scale: Tensor, v_scale: Tensor, dtype: torch.dtype) -> Tensor:
    """A float8 cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` back in ``dtype``."""
    return torch.stack((dequantize_fp8(kv_cache[0], k_scale, dtype), dequantize_fp8(kv_cache[1], v_scale, dtype)))


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    meta: attention.AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """:func:`sonar.kernels.attention.paged_attention`; a float8 cache is read with its scales
    (the context each query reads is dequantized, as the kernels do, not the whole cache); a
    ``softcap`` caps the scores (``c * tanh(s / c)``) before the softmax; ``sinks`` ``[num_heads]``
    join each head's softmax denominator as one more logit with no value."""
    return attention.paged_attention(query, kv_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)


# --- norms and activations ----------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dimension, as ``sonar.models.decoder.RMSNorm`` computes it (float32
    statistics, cast back to ``x.dtype`` before the weight multiplies).

    With ``residual``: ``residual = x + residual`` first (in ``x.dtype``), then the norm of that;
    returns ``(normed, residual)``.
    """
    if residual is not None:
        x = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * h.to(x.dtype)).to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2 * d]``, in ``x.dtype`` as the model's MLP
    computes it (the kernel computes in float32 and rounds once)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(x: Tensor, limit: float, alpha: float) -> Tensor:
    """GPT-OSS's expert activation of ``x`` ``[..., 2 * d]`` (gate then up halves, de-interleaved
    from the checkpoint's alternating columns): the gate clamped to at most ``limit``, the up
    projection to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)`` in
    ``x.dtype``, as transformers computes it."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` for ``x`` ``[..., 2 * d]`` (GELU's tanh approximation,
    transformers' ``gelu_pytorch_tanh``: Gemma's MLP), in ``x.dtype`` as transformers computes it."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# --- rotary embeddings --------------------------------------------------------------------------


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` (halves layout: pairs are ``i`` and ``i + d/2``)
    by ``cos``/``sin`` ``[num_tokens, head_dim]`` (``sonar.models.rotary.RotaryEmbedding.cos_sin``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# --- block copy ---------------------------------------------------------------------------------


def copy_blocks(src: Tensor, dst: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy blocks ``src[:, src_block_ids[i]]`` to ``dst[:, dst_block_ids[i]]`` for KV caches laid
    out ``[2, num_blocks, ...]`` (the block shapes and dtypes must match; the devices may differ,
    e.g. a GPU cache and a CPU staging tensor)."""
    if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(
            f"block shapes/dtypes differ: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}"
        )
    src_ids = src_block_ids.to(device=src.device, dtype=torch.int64)
    dst_ids = dst_block_ids.to(device=dst.device, dtype=torch.int64)
    if src.dtype == FP8_DTYPE:  # index_copy_ has no float8 kernel on CPU: copy the bytes
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)
    # asynchronous only towards a GPU: a GPU -> CPU copy must land before index_copy_ reads it
    dst.index_copy_(1, dst_ids, src.index_select(1, src_ids).to(dst.device, non_blocking=dst.is_cuda))


# --- LoRA adapters ------------------------------------------------------------------------------


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, rows: Tensor, splits: tuple[int, ...]) -> None:
    """Add to each row ``y[i]`` the delta of its adapter slot ``s = rows[i]`` (rows of -1: none),
    in place: for each sub-projection ``j`` (the output columns ``off_j .. off_j + splits[j]``),
    ``t = a[s, j R:(j + 1) R] @ x[i]`` then ``y[i, off_j:off_j + splits[j]] += b[s, off_j:...] @ t``.

    ``a`` ``[S, len(splits) R, in]``, ``b`` ``[S, sum(splits), R]``: zero-padded to the rank ``R``,
    the scaling folded into ``b`` (`sonar.models.lora.LoRALinear`). The arithmetic the kernels
    follow: ``x`` in the adapters' dtype, the shrink ``t`` accumulated in float32 (float64 for
    float64 adapters) and rounded to that dtype, the expand accumulated the same way, and
    ``y + delta`` rounded once to ``y``'s dtype. One pass per slot in use."""
    rank = a.shape[1] // len(splits)
    acc = torch.promote_types(a.dtype, torch.float32)
    active = (rows >= 0).nonzero().flatten()
    slots = rows[active]
    for s in torch.unique(slots).tolist():
        index = active[slots == s]
        t = (x[index].to(a.dtype).to(acc) @ a[s].to(acc).T).to(a.dtype).to(acc)
        deltas, off = [], 0
        for j, size in enumerate(splits):
            deltas.append(t[:, j * rank : (j + 1) * rank] @ b[s, off : off + size].to(acc).T)
            off += size
        y[index] = (y[index].to(acc) + torch.cat(deltas, dim=1)).to(y.dtype)
