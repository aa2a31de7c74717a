"""Bidirectional (non-causal) attention over a flat batch, for encoder models.

An encoder step holds whole sequences back to back (``query_start_loc`` of `AttentionMetadata`
gives each one's rows); every token attends to every token of its own sequence and to nothing
else. Nothing is cached: keys and values are this step's.

On the CPU, head dims 32, 64 and 128 go to the native kernel (``sonar_cpu::encoder_attention``
in ``sonar/kernels/csrc/cpu_ops.cpp``): per (sequence, head) it packs K and V once, then takes
16 query rows at a time through all their scores, a float32 softmax and P V, with bfloat16 pair
dot products (``vdpbf16ps``) on a CPU with AVX512-BF16. Measured on a shared 2-core AVX512-BF16
CPU, one layer's attention over 16 x 256 tokens, best-median of 7, SDPA (as below) vs native:
bge-small's heads (12 of 32) bf16 26.6-27.2 vs 11.1-11.2 ms on one thread, 16-17 vs 5.6-5.8 ms
on two; 12 heads of 64 bf16 45 vs 18.6 ms (one thread), 23 vs 9.5 ms (two); 12 heads of 32
float32 25 vs 22.5 ms (one), a tie at 14-16 ms (two); mixed lengths (7 sequences of 1-512
tokens, 12 heads of 32, bf16, two threads) 3.5 vs 3.1 ms. In the model's profile (bge-small
shape, 16 x 256 tokens) attention went from 35-36% of the forward (15-16 ms a layer) to 18-19%
(6-10 ms). Its mean error against a float32 reference equals SDPA's. Running each query token
through the paged decode kernel instead (keys and values written to a cache first, every token
a one-token query over its whole sequence) measured 2-3x slower than SDPA (16 x 256 bf16, 12
heads of 32: 97 vs 30 ms; of 64: 93 vs 48 ms): a decode reads each key once per query, with an
online-softmax step every 16 keys, where this kernel reuses each packed key tile for 16 queries.

Elsewhere (CUDA, other head dims, code that ``torch.compile`` traces, native kernels
off), sequences of one length are one SDPA call over the batch viewed ``[num_seqs, len, ...]``;
otherwise each sequence is its own SDPA call. Measured on 2 busy CPU cores (12 heads of 64,
best of 5): a padded batch with a key-padding mask was slower in every mixed case (32 x 64-256
tokens: 170 vs 79 ms float32 on one thread; 128 x 4-32 tokens: 30 vs 11 ms), since SDPA takes
its flash kernel only without a mask; for equal lengths the single unmasked call beat the
per-sequence calls (32 x 256: 87 vs 122 ms on one thread, 50 vs 176 ms on two).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from sonar.kernels import ops
from sonar.kernels.attention import AttentionMetadata

NATIVE_HEAD_DIMS = (32, 64, 128)


def sequence_starts(meta: AttentionMetadata) -> list[int]:
    """``query_start_loc`` as a host list, read once per step rather than once per layer."""
    return [int(s) for s in meta.query_start_loc.tolist()]


@functools.cache
def _native_built() -> bool:
    return bool(torch.ops.sonar_cpu.has_encoder_attention())


def use_native(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `encoder_attention` on these tensors takes the native CPU kernel."""
    return (
        q.shape[-1] in NATIVE_HEAD_DIMS
        and ops.use_native(q, k, v)
        and all(x.stride(-1) == 1 for x in (q, k, v))
        and _native_built()
    )


def encoder_attention(
    q: Tensor, k: Tensor, v: Tensor, starts: Sequence[int], scale: float, starts_tensor: Tensor | None = None
) -> Tensor:
    """``q``/``k``/``v`` ``[num_tokens, num_heads, head_dim]`` to the output, shaped as ``q``:
    sequence ``i`` (rows ``starts[i]:starts[i + 1]``) attending over its own rows only.
    ``starts_tensor``: the same offsets as an int32 CPU tensor (the metadata's
    ``query_start_loc``), so the native kernel needs none built per layer."""
    if use_native(q, k, v):
        if starts_tensor is None or starts_tensor.dtype != torch.int32 or starts_tensor.device.type != "cpu":
            starts_tensor = torch.tensor(list(starts), dtype=torch.int32)
        return torch.ops.sonar_cpu.encoder_attention(q, k, v, starts_tensor, scale)
    return sdpa_encoder_attention(q, k, v, starts, scale)


def sdpa_encoder_attention(q: Tensor, k: Tensor, v: Tensor, starts: Sequence[int], scale: float) -> Tensor:
    """`encoder_attention` through SDPA (the path off the native kernel)."""
    num_seqs = len(starts) - 1
    length = starts[1] - starts[0]
    if num_seqs > 1 and all(b - a == length for a, b in zip(starts, starts[1:])):
        heads, dim = q.shape[1], q.shape[2]
        o = F.scaled_dot_product_attention(
            *(x.reshape(num_seqs, length, heads, dim).transpose(1, 2) for x in (q, k, v)), scale=scale
        )
        return o.transpose(1, 2).reshape(q.shape)
    out = q.new_empty(q.shape)
    for begin, end in zip(starts[:-1], starts[1:]):
        rows = slice(begin, end)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), scale=scale
        )
        out[rows] = o.transpose(0, 1)
    return out
