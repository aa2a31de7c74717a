"""Kernel dispatch: the Triton kernel for CUDA tensors when Triton is importable, the native CPU
kernel (`sonar.kernels.native`) for CPU tensors when it is built, the torch reference otherwise.

On the CPU the native kernels serve the KV-cache write, decode attention (and prefill chunks a
token at a time), prefill attention for bfloat16 chunks (`PREFILL_KERNEL_MIN_QUERY`), RMSNorm
(with the residual add fused), SiLU-and-mul and the halves-layout rotary embedding, for the
model's float dtypes; anything else (float8 caches, strided inputs, mixed dtypes, code that
``torch.compile`` traces) takes the reference.
``SONAR_NATIVE_KERNELS=0`` forces the references.

``sonar.kernels.triton`` is imported lazily, on the first CUDA call, so importing this module
never needs Triton and never imports Triton on a CPU-only run. ``SONAR_USE_TRITON=0`` forces the
references on CUDA as well (for A/B checks).

A float8 KV cache written or read without scales uses the per-tensor scale 1.0 (Sonar computes
no KV scales yet), and `paged_attention` takes the decode split count from the metadata when the
caller gives none (the runner fixes it per captured CUDA graph).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch
from torch import Tensor

from sonar.kernels import attention, native, reference
from sonar.kernels.attention import AttentionMetadata


@functools.cache
def _triton_kernels() -> ModuleType | None:
    try:
        import sonar.kernels.triton as kernels
    except ImportError:
        return None
    return kernels


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here."""
    return _triton_kernels() is not None


def use_triton(*tensors: Tensor) -> bool:
    """Whether a call on these tensors goes to Triton: all on CUDA, Triton importable, not while
    ``torch.compile`` traces, and not turned off by ``SONAR_USE_TRITON=0``."""
    if not all(t.is_cuda for t in tensors):  # first: the CPU path pays one attribute read per tensor
        return False
    if torch.compiler.is_compiling():  # inductor generates and fuses its own kernels for these
        return False
    return os.environ.get("SONAR_USE_TRITON", "1") != "0" and triton_available()


NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_native(*tensors: Tensor) -> bool:
    """Whether a call on these tensors goes to the native CPU kernels: all on the CPU in one of
    `NATIVE_DTYPES`, not while ``torch.compile`` traces (the operators have no fake tensors), and
    the kernels built and enabled."""
    dtype = tensors[0].dtype
    if not all(t.device.type == "cpu" and t.dtype == dtype for t in tensors) or dtype not in NATIVE_DTYPES:
        return False
    return not torch.compiler.is_compiling() and native.available()


_UNIT_SCALES: dict[torch.device, Tensor] = {}


def unit_scale(device: torch.device) -> Tensor:
    """The float32 ``[1]`` scale 1.0 on ``device``, one tensor per device (a CUDA graph captured
    with it keeps reading the same memory)."""
    scale = _UNIT_SCALES.get(device)
    if scale is None:
        scale = _UNIT_SCALES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return scale


def _scales(kv_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    if kv_cache.dtype == reference.FP8_DTYPE:
        if k_scale is None:
            k_scale = unit_scale(kv_cache.device)
        if v_scale is None:
            v_scale = unit_scale(kv_cache.device)
    return k_scale, v_scale


def write_kv_cache(
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Store new tokens' K/V at their slots (float8 caches quantize with the scales); negative
    slots (padding rows) are skipped."""
    k_scale, v_scale = _scales(kv_cache, k_scale, v_scale)
    if use_triton(key, kv_cache):
        _triton_kernels().write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    elif use_native(key, value, kv_cache) and key.stride(-1) == 1 and value.stride(-1) == 1:
        torch.ops.sonar_cpu.write_kv_cache(key, value, kv_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal paged attention of a flat batch (see :mod:`sonar.kernels.attention`).
    ``num_splits`` fixes the decode kernel's KV split count (CUDA graphs need one value per
    captured graph; None: ``meta.num_splits``); the reference ignores it. ``softcap`` (None: off)
    caps each scaled score ``s`` to ``softcap * tanh(s / softcap)`` before the softmax: every
    path serves it (the reference with explicit scores in place of SDPA). ``sinks`` (float32
    ``[num_heads]``, None: off) join each head's softmax denominator with no value (GPT-OSS):
    every path serves them too."""
    k_scale, v_scale = _scales(kv_cache, k_scale, v_scale)
    if num_splits is None:
        num_splits = meta.num_splits
    if use_triton(query, kv_cache):
        return _triton_kernels().paged_attention(
            query,
            kv_cache,
            meta,
            scale,
            sliding_window,
            k_scale,
            v_scale,
            num_splits=num_splits,
            softcap=softcap,
            sinks=sinks,
        )
    if use_native(query, kv_cache) and query.stride(-1) == 1:
        return _native_paged_attention(query, kv_cache, meta, scale, sliding_window, softcap, sinks)
    return reference.paged_attention(query, kv_cache, meta, scale, sliding_window, k_scale, v_scale, softcap, sinks)


#: Prefill chunks of sequences up to this long go through the native decode kernel one query
#: token at a time (`attention.TokenSplit`); longer ones through SDPA's flash kernel, which reuses
#: keys across queries. Measured per layer, SmolLM2's heads, 2 threads of an AMD EPYC, bf16 (SDPA
#: with its gathers vs the decode kernel): 4 x 128 fresh tokens 3.33 vs 1.35 ms, 512 over 2048
#: 23.1 vs 20.9 ms, 2048 fresh 76 vs 65 ms, 512 over 8192 102 vs 104 ms (float32 there: 105 vs
#: 146 ms).
PREFILL_AS_DECODES_MAX_LEN = 4096
#: The same for bfloat16 on a CPU with AMX (`native.amx_bf16`), where SDPA's flash kernel runs its
#: products on the tile unit. SmolLM2-135M's whole prefill step of one fresh sequence, 2 cores of a
#: Xeon, decode kernel vs SDPA: 128 tokens 56-62 vs 54-74 ms, 512 239-252 vs 151 ms, 1024 729 vs
#: 326-335 ms, 2048 2.52-2.60 vs 0.85-0.86 s.
AMX_PREFILL_AS_DECODES_MAX_LEN = 256
#: bfloat16 chunks of at least this many query tokens go to the native prefill kernel
#: (`sonar_cpu::prefill_attention`, which packs each sequence's keys once and reuses them across
#: its queries) instead of the decode kernel token by token, at any length (with AMX, up to
#: `AMX_PREFILL_AS_DECODES_MAX_LEN`; SDPA serves longer ones there). Without softcapping.
PREFILL_KERNEL_MIN_QUERY = 16
PREFILL_KERNEL_HEAD_DIMS = (32, 64, 128)


@functools.cache
def _prefill_kernel_built() -> bool:
    return bool(torch.ops.sonar_cpu.has_prefill_attention())


def _native_paged_attention(
    query: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Each sequence's query tokens through one of three: bfloat16 prefill chunks of at least
    `PREFILL_KERNEL_MIN_QUERY` tokens through the native prefill kernel; the other tokens of
    sequences up to `PREFILL_AS_DECODES_MAX_LEN` long (with AMX and bfloat16,
    `AMX_PREFILL_AS_DECODES_MAX_LEN`) through the native decode kernel, straight from the paged
    cache; the prefills of longer ones as the reference."""
    amx = query.dtype == torch.bfloat16 and native.amx_bf16()
    max_len = AMX_PREFILL_AS_DECODES_MAX_LEN if amx else PREFILL_AS_DECODES_MAX_LEN
    kernel = (
        query.dtype == torch.bfloat16
        and softcap is None
        and query.shape[-1] in PREFILL_KERNEL_HEAD_DIMS
        and _prefill_kernel_built()
    )
    if kernel:
        split = meta.token_split(max_len, PREFILL_KERNEL_MIN_QUERY, max_len if amx else None)
    else:
        split = meta.token_split(max_len)
    out = torch.empty(query.shape, dtype=query.dtype)
    sink_logits = None if sinks is None else sinks.float().contiguous()
    if split.num_rows:
        torch.ops.sonar_cpu.decode_attention(
            out,
            query,
            kv_cache,
            split.block_tables,
            split.seq_lens,
            split.rows,
            scale,
            sliding_window or -1,
            softcap or 0.0,
            sink_logits,
        )
    if split.kernel_prefills:
        torch.ops.sonar_cpu.prefill_attention(
            out,
            query,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            split.kernel_seqs,
            scale,
            sliding_window or -1,
            sink_logits,
        )
    if split.prefills:
        attention.prefill_attention(query, kv_cache, meta, scale, sliding_window, out, split.prefills, softcap, sinks)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm; with ``residual`` returns ``(normed, x + residual)``. The Triton path updates
    ``residual`` in place, the reference returns a new tensor: use the returned one."""
    if use_triton(x, weight):
        return _triton_kernels().rms_norm(x, weight, eps, residual)
    if use_native(x, weight) and x.is_contiguous():
        if residual is None:
            return torch.ops.sonar_cpu.rms_norm(x, weight, eps)
        if use_native(residual, x) and residual.is_contiguous():
            return torch.ops.sonar_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return reference.rms_norm(x, weight, eps, residual)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`reference.apply_rotary` (halves layout, ``cos``/``sin`` ``[num_tokens, head_dim]``
    in ``x.dtype``): one native pass on the CPU, the torch expression elsewhere (on CUDA Inductor
    fuses it under ``-O2``)."""
    if use_native(x, cos, sin) and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        return torch.ops.sonar_cpu.rotary(x, cos, sin)
    return reference.apply_rotary(x, cos, sin)


def silu_and_mul(x: Tensor) -> Tensor:
    if use_triton(x):
        return _triton_kernels().silu_and_mul(x)
    if use_native(x) and x.is_contiguous():
        return torch.ops.sonar_cpu.silu_and_mul(x)
    return reference.silu_and_mul(x)


def row_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(dim=-1)`` of a 2-D tensor: each row's largest value and the index of its first
    occurrence, NaN counting as the largest. The native kernel for contiguous float32 CPU logits
    (torch's reduction with indices is ~20x slower there), torch elsewhere."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 and x.is_contiguous() and use_native(x):
        return torch.ops.sonar_cpu.row_max(x)
    best, index = x.max(dim=-1)
    return best, index


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """`reference.gelu_tanh_and_mul` on every device (no kernel of its own: on CUDA under ``-O2``
    Inductor fuses it into one pass)."""
    return reference.gelu_tanh_and_mul(x)


def copy_blocks(src: Tensor, dst: Tensor, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
    """Copy KV blocks between caches: the kernel when both caches are on one GPU, torch (a gather,
    one copy, a scatter) across devices."""
    if use_triton(src, dst) and src.device == dst.device:
        device = src.device
        _triton_kernels().copy_blocks(
            src, dst, src_block_ids.to(device, torch.int64), dst_block_ids.to(device, torch.int64)
        )
    else:
        reference.copy_blocks(src, dst, src_block_ids, dst_block_ids)
