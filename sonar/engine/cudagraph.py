"""CUDA graphs for decode steps: static padded input buffers, capture sizes, capture and replay.

A pure-decode step (one new token per request) of ``n`` requests runs as the captured graph of
the smallest capture size ``>= n``: its inputs are copied into static buffers, rows ``n ..
size - 1`` are padding (token 0, position 0, slot -1 so nothing is written to the KV cache,
context length 0 so attention reads nothing), and the graph is replayed; its first ``n`` output
rows are the step's hidden states. Attention metadata in the graph is fixed per size: the block
tables are ``max_model_len / block_size`` wide, ``max_seq_len`` is the max model length and the
decode kernel's split count is chosen once per size, so replays never depend on host values.

`DecodeBuffers` is the same padded path without graphs: the runner's tests run it on the CPU
to show that padding changes neither the real rows' results nor any KV block it does not own.

Capture sizes follow the documented rule: ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1,
16)`` with ``max = min(2 * max_num_seqs, 512)``, unless ``--cudagraph-capture-sizes`` lists them
(sorted, deduplicated; ``--max-cudagraph-capture-size``, if also given, must be its largest) or
``--max-cudagraph-capture-size`` sets ``max``. Sizes above ``--max-num-batched-tokens`` can never
be scheduled and are dropped. ``--enforce-eager`` captures nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sonar.kernels.attention import AttentionMetadata
from sonar.log import get_logger

log = get_logger("sonar.cudagraph")


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest capture size that holds ``n`` rows (None: more rows than any graph)."""
    for size in sizes:
        if size >= n:
            return size
    return None


class DecodeBuffers:
    """Static, padded inputs of a decode batch of up to ``max_size`` rows (see the module docstring)."""

    def __init__(self, max_size: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_size = max_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_size, width), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        # host staging: one copy per buffer per step, asynchronous from pinned memory
        self._host_ids = torch.zeros(max_size, dtype=torch.int64, pin_memory=pin)
        self._host_positions = torch.zeros(max_size, dtype=torch.int64, pin_memory=pin)
        self._host_slots = torch.full((max_size,), -1, dtype=torch.int64, pin_memory=pin)
        self._host_seq_lens = torch.zeros(max_size, dtype=torch.int32, pin_memory=pin)
        self._host_tables = torch.zeros((max_size, width), dtype=torch.int32, pin_memory=pin)

    def fill(self, size: int, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """Rows ``0 .. n - 1`` from one decode token per request (its id, its position, its block
        ids); rows ``n .. size - 1`` become padding."""
        n = len(ids)
        if not 0 < n <= size <= self.max_size:
            raise ValueError(f"cannot pad {n} rows to {size} (buffers hold {self.max_size})")
        bs = self.block_size
        self._host_ids[:n] = torch.tensor(ids, dtype=torch.int64)
        self._host_ids[n:size] = 0
        pos = torch.tensor(positions, dtype=torch.int64)
        self._host_positions[:n] = pos
        self._host_positions[n:size] = 0
        self._host_seq_lens[:n] = pos + 1
        self._host_seq_lens[n:size] = 0
        table = self._host_tables
        width = table.shape[1]
        padded: list[int] = []  # rows 0 .. n - 1 as one list: one tensor, not one per row
        for i, blocks in enumerate(tables):
            if len(blocks) * bs <= positions[i] or positions[i] >= self.max_model_len:
                raise ValueError(
                    f"row {i}: {len(blocks)} blocks of {bs} (max model len {self.max_model_len}) "
                    f"cannot hold position {positions[i]}"
                )
            blocks = blocks[:width]  # blocks past the max model length are never read
            padded += blocks
            padded += [0] * (width - len(blocks))
        table[:n] = torch.tensor(padded, dtype=torch.int32).view(n, width)
        table[n:size] = 0
        rows = torch.arange(n)
        self._host_slots[:n] = table[rows, pos // bs].to(torch.int64) * bs + pos % bs
        self._host_slots[n:size] = -1
        for dst, src in (
            (self.input_ids, self._host_ids),
            (self.positions, self._host_positions),
            (self.slot_mapping, self._host_slots),
            (self.seq_lens, self._host_seq_lens),
            (self.block_tables, self._host_tables),
        ):
            dst[:size].copy_(src[:size], non_blocking=True)

    def metadata(self, size: int, num_splits: int | None = None) -> AttentionMetadata:
        """Attention metadata over the first ``size`` rows: views of the static buffers."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_splits=num_splits,
        )


def decode_num_splits(size: int, num_kv_heads: int, max_model_len: int, device: torch.device) -> int | None:
    """The decode kernel's split count for a captured size (None off CUDA: the reference has none)."""
    if device.type != "cuda":
        return None
    from sonar.kernels.triton.decode_attention import default_num_splits

    return default_num_splits(size, num_kv_heads, max_model_len, device)


Forward = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]
"""The model's forward over (input ids, positions, metadata) with the KV caches bound."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: Tensor


class CudaGraphs:
    """One captured decode graph per size, sharing one memory pool (captured largest first, so
    the smaller ones reuse the largest one's memory)."""

    def __init__(self, forward: Forward, buffers: DecodeBuffers, sizes: Sequence[int], num_kv_heads: int) -> None:
        self.forward = forward
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.num_kv_heads = num_kv_heads
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture ``sizes`` (default: all), largest first, after two warm-up runs each."""
        device = self.buffers.device
        started = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        b = self.buffers
        for size in sorted(sizes if sizes is not None else self.sizes, reverse=True):
            meta = b.metadata(size, decode_num_splits(size, self.num_kv_heads, b.max_model_len, device))
            b.input_ids[:size].zero_()
            b.positions[:size].zero_()
            b.slot_mapping[:size].fill_(-1)
            b.seq_lens[:size].zero_()
            for _ in range(2):  # warm-up: kernel compilation and lazy allocations happen outside the graph
                self.forward(b.input_ids[:size], b.positions[:size], meta)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.forward(b.input_ids[:size], b.positions[:size], meta)
            self.graphs[size] = _Graph(graph, output)
        torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - started
        self.memory_bytes += max(free_before - torch.cuda.mem_get_info(device)[0], 0)

    def run(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> Tensor | None:
        """Hidden states ``[n, hidden]`` of a decode batch by graph replay, or None when no
        captured size holds it."""
        size = padded_size(self.sizes, len(ids))
        if size is None or size not in self.graphs:
            return None
        self.buffers.fill(size, ids, positions, tables)
        entry = self.graphs[size]
        entry.graph.replay()
        return entry.output[: len(ids)]

    def release(self) -> None:
        """Drop every graph and the pool (the estimate pass captures, measures, then releases)."""
        self.graphs.clear()
        self.pool = None
        torch.cuda.synchronize(self.buffers.device)
        torch.cuda.empty_cache()
