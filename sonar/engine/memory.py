"""The device-memory contract, as pure arithmetic over measured numbers.

* ``--gpu-memory-utilization u`` asks for ``u`` times the device's *total* memory. Startup fails
  when that much is not free at start (`check_free_memory`); the fraction is never reapplied to
  what happens to be free.
* Out of that budget come the weights, the peak activations of a profiling forward pass at
  ``--max-num-batched-tokens``, memory outside torch's allocator (CUDA context growth, cuBLAS
  workspaces) and the CUDA graphs; the rest is the KV cache (`kv_cache_bytes`).
* The log names the ``--kv-cache-memory-bytes`` value that gives the same number of blocks
  (`reproduce_bytes`); passing it skips profiling.
* ``--max-model-len auto`` keeps the model's own length when it fits the cache, else the longest
  that does (`fit_max_model_len`).

On CPU there is no profiling: the KV cache gets ``--kv-cache-memory-bytes``, else
`DEFAULT_CPU_KV_BYTES` or a tenth of the machine's memory, whichever is less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar.engine.settings import check_kv_cache_dtype
from sonar.errors import SonarError
from sonar.units import format_memory_size

DEFAULT_CPU_KV_BYTES = 2 * 2**30

KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
"""``--kv-cache-dtype`` values Sonar implements (besides ``auto``, the model's dtype)."""


class DeviceMemoryError(SonarError, ValueError):
    """The memory settings cannot be met on this device; the message names the flag to change."""


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``--kv-cache-dtype name`` for a model computing in ``model_dtype``."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values (fp8: half of bfloat16)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def default_cpu_kv_bytes(physical_memory: int) -> int:
    return min(DEFAULT_CPU_KV_BYTES, physical_memory // 10)


def requested_bytes(total: int, utilization: float) -> int:
    return int(total * utilization)


def check_free_memory(total: int, free: int, utilization: float) -> int:
    """The budget ``utilization * total``; raises `DeviceMemoryError` when less than that is free."""
    requested = requested_bytes(total, utilization)
    if free < requested:
        fits = int(free / total * 100) / 100
        raise DeviceMemoryError(
            f"--gpu-memory-utilization {utilization} asks for {format_memory_size(requested)} of the device's "
            f"{format_memory_size(total)}, but only {format_memory_size(free)} is free "
            f"({format_memory_size(total - free)} in use by other processes); it is a share of the total "
            f"memory, not of the free memory: lower it to {fits} or less, or free the device"
        )
    return requested


@dataclass(frozen=True)
class CudaBaseline:
    """The device memory in use when an instance starts (bytes): by everything (``used``, other
    processes and this one's CUDA context included) and by this process's torch allocator
    (``allocated``, ``reserved``: an earlier engine in the same process leaves its cached blocks
    there). The profile counts only what grew from here."""

    used: int
    allocated: int
    reserved: int


@dataclass(frozen=True)
class MemoryProfile:
    """What one instance uses besides its KV cache, measured at startup (bytes)."""

    total: int
    utilization: float
    weights: int
    peak_activations: int
    non_torch: int
    graphs: int
    tower: int = 0
    """A vision model's tower on the largest image a request can bring (0: none, or
    ``--skip-mm-profiling``); `peak_activations` is the larger of it and the forward pass's."""

    @property
    def requested(self) -> int:
        return requested_bytes(self.total, self.utilization)

    @property
    def non_kv(self) -> int:
        return self.weights + self.peak_activations + max(self.non_torch, 0) + self.graphs

    def describe(self) -> dict[str, str]:
        return {
            name: format_memory_size(max(getattr(self, name), 0))
            for name in ("requested", "weights", "peak_activations", "tower", "non_torch", "graphs")
        }


def kv_cache_bytes(profile: MemoryProfile) -> int:
    """The budget left for the KV cache; raises `DeviceMemoryError` when nothing is left."""
    left = profile.requested - profile.non_kv
    if left <= 0:
        raise DeviceMemoryError(
            f"no memory left for the KV cache: --gpu-memory-utilization {profile.utilization} allows "
            f"{format_memory_size(profile.requested)}, and the weights ({format_memory_size(profile.weights)}), "
            f"activations ({format_memory_size(profile.peak_activations)}), CUDA graphs "
            f"({format_memory_size(profile.graphs)}) and other allocations ({format_memory_size(max(profile.non_torch, 0))}) "
            f"take {format_memory_size(profile.non_kv)}: raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens or --max-num-seqs, or pass --enforce-eager"
        )
    return left


def num_blocks_for(kv_bytes: int, per_block: int) -> int:
    """Whole blocks in ``kv_bytes``; raises ValueError when not even one fits."""
    blocks = kv_bytes // per_block
    if blocks < 1:
        raise DeviceMemoryError(
            f"the KV cache ({format_memory_size(kv_bytes)}) holds no block of {per_block} bytes; give it more memory"
        )
    return blocks


def reproduce_bytes(num_blocks: int, per_block: int) -> int:
    """The ``--kv-cache-memory-bytes`` value that gives exactly ``num_blocks`` blocks again."""
    return num_blocks * per_block


@dataclass(frozen=True)
class ModelLen:
    value: int
    reduced_from: int | None = None
    """The model's own maximum, when ``value`` is a reduction of it to fit the cache."""


def fit_max_model_len(requested: int | None, model_max: int, num_blocks: int, block_size: int) -> ModelLen:
    """The max model length from ``--max-model-len`` (None: the model's; -1: auto) and the cache.

    Unset or auto: the model's maximum, reduced to the cache's capacity when it does not fit.
    An explicit value must not exceed the model's maximum nor the cache's capacity.
    """
    capacity = num_blocks * block_size
    if requested is not None and requested != -1:
        if requested > model_max:
            raise ValueError(f"max_model_len {requested} exceeds the model's maximum {model_max}")
        if requested > capacity:
            raise ValueError(
                f"max_model_len {requested} needs {-(-requested // block_size)} KV blocks but the cache holds "
                f"{num_blocks} ({capacity} tokens): lower max_model_len or give the KV cache more memory"
            )
        return ModelLen(requested)
    if model_max > capacity:
        return ModelLen(capacity, reduced_from=model_max)
    return ModelLen(model_max)
