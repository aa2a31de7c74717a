"""Checks of engine settings that need no torch: the server validates its flags (and starts its
worker process) before this process imports torch.

The CUDA graph capture sizes follow the rule `sonar.engine.cudagraph` documents.
"""

from __future__ import annotations

from typing import Any

KV_CACHE_DTYPE_NAMES = ("bfloat16", "float16", "fp8", "fp8_e4m3")
"""``--kv-cache-dtype`` values Sonar implements besides ``auto`` (`sonar.engine.memory.KV_CACHE_DTYPES`
maps them to torch dtypes)."""


def default_capture_sizes(max_size: int) -> list[int]:
    pattern = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in pattern if s <= max_size]


def capture_sizes(config: Any) -> list[int]:
    """The decode batch sizes to capture for an `EngineConfig` (empty with ``enforce_eager`` or ``-O0``);
    raises ValueError, naming the flag, for invalid settings."""
    given = config.cudagraph_capture_sizes
    max_size = config.max_cudagraph_capture_size
    if max_size is not None and max_size <= 0:
        raise ValueError(f"max_cudagraph_capture_size must be positive, got {max_size}")
    if given is not None:
        if any(s <= 0 for s in given):
            raise ValueError(f"cudagraph_capture_sizes must be positive integers, got {list(given)}")
        sizes = sorted(set(given))
        if max_size is not None and sizes and max_size != sizes[-1]:
            raise ValueError(
                f"max_cudagraph_capture_size {max_size} must equal the largest of "
                f"cudagraph_capture_sizes ({sizes[-1]}) when both are given"
            )
    else:
        sizes = default_capture_sizes(max_size if max_size is not None else min(config.max_num_seqs * 2, 512))
    if config.enforce_eager or config.optimization_level == 0:
        return []
    return [s for s in sizes if s <= config.max_num_batched_tokens]


def parse_device_ids(device_ids: str | None) -> int | None:
    """The one CUDA index of ``--device-ids`` (None when unset); ValueError for anything else."""
    if device_ids is None or not device_ids.strip():
        return None
    ids = [part.strip() for part in device_ids.split(",") if part.strip()]
    if len(ids) != 1 or not ids[0].isdigit():
        raise ValueError(
            f"device_ids {device_ids!r}: Sonar serves from one device; give one CUDA index such as 0 "
            "(or select devices with CUDA_VISIBLE_DEVICES)"
        )
    return int(ids[0])


def check_load_settings(config: Any) -> None:
    """Raise ValueError (a `ModelLoadError`) for a load format, loader setting or safetensors strategy
    of an `EngineConfig` that Sonar does not implement."""
    from sonar.models.load_formats import check_load_format, loader_extra, safetensors_strategy

    check_load_format(config.load_format)
    loader_extra(config.load_format, config.model_loader_extra_config)
    safetensors_strategy(config.safetensors_load_strategy)
    if config.tokenizer_revision is not None and config.tokenizer is not None:
        raise ValueError(
            f"tokenizer_revision with tokenizer {config.tokenizer!r} is not supported yet: the revision applies to "
            "the model's own tokenizer files; pass tokenizer a local folder at the revision you want"
        )


def check_kv_cache_dtype(name: str) -> None:
    """Raise ValueError for a ``--kv-cache-dtype`` Sonar does not implement."""
    if name == "auto" or name in KV_CACHE_DTYPE_NAMES:
        return
    if name == "fp8_e5m2":
        raise ValueError("kv_cache_dtype fp8_e5m2 is not supported: Sonar's fp8 KV cache is e4m3 (use fp8 or fp8_e4m3)")
    raise ValueError(f"kv_cache_dtype {name!r} is not supported yet (auto, {', '.join(KV_CACHE_DTYPE_NAMES)})")


EXPERT_PLACEMENTS = ("linear", "round_robin")
"""``--expert-placement-strategy`` values (`sonar.models.parallel.TensorParallel.local_experts`)."""


def check_expert_parallel(config: Any) -> None:
    """Raise ValueError for expert-parallel settings of an `EngineConfig` Sonar does not implement.

    The expert-parallel group is the tensor-parallel one: data-parallel replicas are independent
    engines, each holding every expert, so expert parallelism over them (the reference server's
    EP = TP x DP) has nothing to split when tensor_parallel_size is 1."""
    strategy = config.expert_placement_strategy
    if strategy not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert_placement_strategy must be one of {', '.join(EXPERT_PLACEMENTS)}, got {strategy!r}")
    check_eplb(config)
    if not config.enable_expert_parallel:
        return
    if config.tensor_parallel_size == 1 and config.data_parallel_size > 1:
        raise ValueError(
            f"enable_expert_parallel with data_parallel_size {config.data_parallel_size} and tensor_parallel_size 1 "
            "is not supported: Sonar splits experts over the tensor-parallel ranks of one engine, and its "
            "data-parallel replicas are independent engines that each hold every expert; "
            "set tensor_parallel_size > 1 to split them"
        )


def check_eplb(config: Any) -> None:
    """Raise ValueError for expert load balancing settings that cannot take effect: EPLB moves
    experts between expert-parallel ranks, so it needs expert parallelism over several of them."""
    from sonar.core.eplb import EplbConfig

    if not config.enable_eplb:
        if config.eplb_config:
            raise ValueError(
                f"eplb_config ({', '.join(sorted(config.eplb_config))}) is set but expert load balancing is off: "
                "add enable_eplb (--enable-eplb)"
            )
        return
    EplbConfig.parse(config.eplb_config)
    if not config.enable_expert_parallel:
        raise ValueError(
            "enable_eplb needs enable_expert_parallel (--enable-expert-parallel): it balances whole experts "
            "between expert-parallel ranks, and without expert parallelism every rank holds a slice of every expert"
        )
    if config.tensor_parallel_size == 1:
        raise ValueError(
            "enable_eplb with tensor_parallel_size 1 is not supported: the expert-parallel ranks are the "
            "tensor-parallel ones, and one rank holding every expert has nothing to balance"
        )
