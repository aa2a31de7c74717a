"""The device-memory contract as arithmetic (`sonar.engine.memory`), with plain numbers."""

from __future__ import annotations

import pytest
import torch

from sonar.engine import memory
from sonar.engine.memory import DeviceMemoryError, MemoryProfile

GiB = 2**30


def test_utilization_is_a_share_of_total_memory_not_of_free() -> None:
    assert memory.check_free_memory(total=80 * GiB, free=79 * GiB, utilization=0.92) == int(80 * GiB * 0.92)
    with pytest.raises(DeviceMemoryError) as info:  # another process holds 20 GiB: 73.6 GiB are not free
        memory.check_free_memory(total=80 * GiB, free=60 * GiB, utilization=0.92)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--gpu-memory-utilization 0.92 asks for 73.60 GiB of the device's 80.00 GiB")
    assert "only 60.00 GiB is free" in message and "lower it to 0.75 or less" in message
    assert memory.check_free_memory(total=80 * GiB, free=60 * GiB, utilization=0.75) == 60 * GiB


def test_kv_cache_gets_the_rest_of_the_budget() -> None:
    profile = MemoryProfile(
        total=80 * GiB, utilization=0.5, weights=10 * GiB, peak_activations=3 * GiB, non_torch=GiB, graphs=GiB // 2
    )
    assert profile.requested == 40 * GiB
    assert memory.kv_cache_bytes(profile) == 40 * GiB - 14 * GiB - GiB // 2
    tight = MemoryProfile(total=16 * GiB, utilization=0.5, weights=7 * GiB, peak_activations=GiB, non_torch=0, graphs=0)
    with pytest.raises(DeviceMemoryError, match="no memory left for the KV cache: --gpu-memory-utilization 0.5"):
        memory.kv_cache_bytes(tight)


def test_a_negative_non_torch_delta_counts_as_zero() -> None:
    profile = MemoryProfile(total=10 * GiB, utilization=1.0, weights=GiB, peak_activations=0, non_torch=-GiB, graphs=0)
    assert memory.kv_cache_bytes(profile) == 9 * GiB
    assert profile.describe()["non_torch"] == "0 B"  # logged at startup: a negative delta must not raise


def test_logged_kv_bytes_reproduce_the_block_count() -> None:
    per_block = memory.kv_bytes_per_block(28, 16, 8, 128, torch.bfloat16)
    assert per_block == 2 * 28 * 16 * 8 * 128 * 2
    blocks = memory.num_blocks_for(10 * GiB + 12345, per_block)
    flag = memory.reproduce_bytes(blocks, per_block)
    assert memory.num_blocks_for(flag, per_block) == blocks
    with pytest.raises(DeviceMemoryError, match="holds no block"):
        memory.num_blocks_for(per_block - 1, per_block)


def test_fp8_halves_bytes_per_block_and_doubles_blocks() -> None:
    bf16 = memory.kv_bytes_per_block(30, 16, 3, 64, memory.kv_cache_torch_dtype("auto", torch.bfloat16))
    fp8 = memory.kv_bytes_per_block(30, 16, 3, 64, memory.kv_cache_torch_dtype("fp8", torch.bfloat16))
    assert bf16 == 2 * fp8
    assert memory.num_blocks_for(1000 * bf16, fp8) == 2 * memory.num_blocks_for(1000 * bf16, bf16) == 2000
    assert memory.kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert memory.kv_cache_torch_dtype("float16", torch.bfloat16) == torch.float16


def test_unsupported_kv_cache_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported: Sonar's fp8 KV cache is e4m3"):
        memory.check_kv_cache_dtype("fp8_e5m2")
    with pytest.raises(ValueError, match="'nvfp4' is not supported yet"):
        memory.check_kv_cache_dtype("nvfp4")


@pytest.mark.parametrize(
    ("requested", "model_max", "blocks", "expected", "reduced"),
    [
        (None, 2048, 1000, 2048, None),  # fits: the model's own length
        (-1, 2048, 1000, 2048, None),
        (-1, 40960, 1000, 16000, 40960),  # auto: the longest that fits, logged as a reduction
        (None, 40960, 1000, 16000, 40960),
        (4096, 40960, 1000, 4096, None),
    ],
)
def test_max_model_len_fits_the_cache(requested, model_max, blocks, expected, reduced) -> None:
    fitted = memory.fit_max_model_len(requested, model_max, blocks, 16)
    assert (fitted.value, fitted.reduced_from) == (expected, reduced)


def test_explicit_max_model_len_that_does_not_fit_fails() -> None:
    with pytest.raises(ValueError, match="max_model_len 32000 needs 2000 KV blocks but the cache holds 1000"):
        memory.fit_max_model_len(32000, 40960, 1000, 16)
    with pytest.raises(ValueError, match="exceeds the model's maximum 2048"):
        memory.fit_max_model_len(4096, 2048, 1000, 16)
