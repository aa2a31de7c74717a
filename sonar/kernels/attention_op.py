"""Attention as one opaque operator, so ``torch.compile`` can take the rest of the decoder.

A decoder layer's attention writes the new tokens' keys and values into the layer's paged KV
cache and attends over it (:mod:`sonar.kernels.attention` for the layouts). Both steps depend
on the step's `AttentionMetadata`, a Python object of host-side lists and index tensors that
must not reach a compiled graph (every value in it would become a guard, and every step a
recompile). So:

* `step_metadata` is a context manager that makes one step's metadata current for the calling
  thread (the worker runs steps in a thread; other threads see their own, or none).
* ``torch.ops.sonar.attention(query, key, value, kv_cache, scale, sliding_window, softcap, sinks)`` is a
  ``torch.library`` custom operator that reads the current metadata, writes ``key``/``value``
  into ``kv_cache`` (declared mutated) and returns paged attention of ``query``. Its fake
  implementation only allocates the output, so Dynamo and Inductor treat it as a black box
  between the fused element-wise code before and after it.
* `attention` is what the model calls: the operator while compiling, the plain functions in
  eager mode (same arithmetic, without the operator's dispatch cost).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from sonar.errors import SonarError
from sonar.kernels import ops
from sonar.kernels.attention import AttentionMetadata

_current = threading.local()


class MissingStepMetadataError(SonarError, RuntimeError):
    """Attention ran with no `AttentionMetadata` passed and none made current by `step_metadata`."""


@contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    """Make `meta` the current step's metadata for this thread while the block runs (nests: the
    previous one is restored on exit)."""
    previous = getattr(_current, "meta", None)
    _current.meta = meta
    try:
        yield meta
    finally:
        _current.meta = previous


def current_metadata() -> AttentionMetadata:
    """The metadata `step_metadata` made current in this thread."""
    meta = getattr(_current, "meta", None)
    if meta is None:
        raise MissingStepMetadataError(
            "sonar attention ran outside a step: wrap the forward pass in "
            "sonar.kernels.attention_op.step_metadata(meta)"
        )
    return meta


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    ops.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    return ops.paged_attention(query, kv_cache, meta, scale, sliding_window, softcap=softcap, sinks=sinks)


@torch.library.custom_op("sonar::attention", mutates_args=("kv_cache",))
def attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` at the
    current step's slots, then return causal paged attention of ``query``
    ``[num_tokens, num_heads, head_dim]`` (same shape and dtype as ``query``)."""
    out = _attend(query, key, value, kv_cache, current_metadata(), scale, sliding_window, softcap, sinks)
    return out.contiguous()  # the layout the fake promises, which compiled code relies on


@attention_op.register_fake
def _attention_fake(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None = None,
) -> Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """One layer's KV-cache write and paged attention, with the current step's metadata
    (`step_metadata`); ``softcap`` caps the scores, ``sinks`` join each head's softmax
    (`sonar.kernels.ops.paged_attention`). The
    compiled forward pass goes through ``torch.ops.sonar.attention``, eager code calls the
    functions directly.
    """
    if torch.compiler.is_compiling():
        return attention_op(query, key, value, kv_cache, scale, sliding_window, softcap, sinks)
    return _attend(query, key, value, kv_cache, current_metadata(), scale, sliding_window, softcap, sinks)
