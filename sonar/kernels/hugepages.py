"""Large CPU tensors on fresh anonymous memory: the packed weights on transparent huge pages
(2 MiB), the KV caches zero-filled lazily.

A CPU decode step reads every packed weight once. On 4 KiB pages that is a page walk every 4 KiB
and the hardware prefetchers stop at each page boundary; on 2 MiB pages neither happens. Measured
on SmolLM2-135M, 2 cores (`BENCHMARKS.md`): decode steps 0.92x the time at batch 16 and 0.96x at
batch 1 with the packed weights here.

Linux hands out huge pages for anonymous memory only where the mapping asks for them
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most distributions) and only
for memory not touched yet. `empty` therefore maps fresh private anonymous memory of its own (not
the allocator's, which may hand back pages it already touched), a little more than asked,
advises the 2 MiB-aligned span inside it with ``madvise(MADV_HUGEPAGE)`` before anything writes
to it, and returns a view of that span; `arena` lays many smaller tensors side by side in one
such span. The kernel backs the advised span with huge pages as it can (best effort: memory too
fragmented gets 4 KiB pages). Where advising is not possible (not Linux, tensors under 2 MiB, the
call failing) it is plain ``torch.empty``: huge pages are a speed-up, never a requirement.

`zeros` serves the KV caches, which are not on huge pages (measured about as fast, and faulting
in several GiB of huge pages at start-up made the kernel compact memory: seconds). A fresh
mapping reads as zeros and the kernel fills each page on its first touch, so a cache of several
GiB costs nothing at start-up (``torch.zeros`` writes every page: seconds on this machine) and
only the pages requests reach are ever backed.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _mapping(nbytes: int) -> tuple[mmap.mmap, Tensor] | None:
    """A fresh private anonymous mapping and a uint8 tensor over it (which holds it alive); None
    where none can be made."""
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, OSError, ValueError):  # AttributeError: no MAP_PRIVATE (not POSIX)
        return None
    return region, torch.frombuffer(region, dtype=torch.uint8)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous CPU tensor, on huge pages where the system gives them."""
    nbytes = _nbytes(shape, dtype)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapped = _mapping(span + HUGE_PAGE)
    if mapped is None:
        return torch.empty(shape, dtype=dtype)
    region, raw = mapped
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A contiguous CPU tensor of zeros whose pages the kernel fills on first touch (large
    tensors; small ones and systems without such mappings get ``torch.zeros``)."""
    nbytes = _nbytes(shape, dtype)
    mapped = _mapping(nbytes) if nbytes >= HUGE_PAGE else None
    if mapped is None:
        return torch.zeros(shape, dtype=dtype)
    return mapped[1].view(dtype).view(shape)


def arena(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[Tensor]:
    """Uninitialized contiguous tensors of `shapes`, side by side in one allocation on huge pages
    where the system gives them, each 64-byte aligned. Many tensors under 2 MiB each — a small
    model's per-layer weights — share huge pages this way."""
    if not shapes:
        return []
    align = max(1, 64 // dtype.itemsize)
    starts, total = [], 0
    for shape in shapes:
        starts.append(total)
        total += -(-math.prod(shape) // align) * align
    space = empty((total,), dtype)
    return [space[start : start + math.prod(shape)].view(shape) for shape, start in zip(shapes, starts)]
