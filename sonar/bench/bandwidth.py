"""This machine's memory read bandwidth, measured the way a decode step reads its weights.

A batch-1 decode step streams every weight from memory once, so its floor is weight bytes over
read bandwidth. The bandwidth is measured, not assumed: summing a buffer far larger than the
caches, on all cores, best of a few passes (the first touches the pages).
"""

from __future__ import annotations

import os
import time


def read_bandwidth_gbs(size_bytes: int = 512 << 20, passes: int = 6, threads: int | None = None) -> float:
    """GB/s of reading a `size_bytes` float32 buffer with `torch.sum` on `threads` threads
    (default: every core), the best of `passes` passes."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return size_bytes / best / 1e9
