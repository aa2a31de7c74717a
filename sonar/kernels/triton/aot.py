"""Compile every kernel for a GPU target without a GPU: ``python -m sonar.kernels.triton.aot``.

The wrappers are called on small CPU tensors with real model shapes (32 query heads over 8 KV
heads of 128 dims, blocks of 16, bf16 and float8 caches) while each kernel object is swapped for a
recorder that keeps the launch (arguments, constexprs, ``num_warps``/``num_stages``) instead of
running it; each recorded launch is then compiled with ``triton.compile`` for the target (default
sm_90, the H100/H200) down to a cubin with the ptxas that ships in Triton's wheel. That catches,
on a CPU machine, what the interpreter cannot: code that does not lower for the GPU (dot shapes,
float8 conversions, layouts) or that needs more shared memory than the chip has. Run it without
``TRITON_INTERPRET`` set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
}


@dataclass
class Launch:
    name: str
    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``rec[grid](*args, **kwargs)`` records the call."""

    def __init__(self, name: str, kernel: Any, launches: list[Launch]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.name, self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def recording(modules: list[ModuleType]) -> Iterator[list[Launch]]:
    """Swap every kernel (a module global whose name starts with ``_`` and ends in ``_kernel``)
    for a recorder while the block runs."""
    launches: list[Launch] = []
    swapped: list[tuple[ModuleType, str, Any]] = []
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                swapped.append((module, name, value))
                setattr(module, name, _Recorder(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", value, launches))
    try:
        yield launches
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def _signature(launch: Launch) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[str, int]]:
    """Triton signature and constexprs of a recorded launch, and its compile options."""
    fn = launch.kernel
    names = fn.arg_names
    options = {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}
    values = dict(zip(names, launch.args))
    values.update({k: v for k, v in launch.kwargs.items() if k not in options})
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(names):
        value = values[name]
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def record_launches() -> list[Launch]:
    """Call every wrapper once per variant that the GPU path uses, recording the launches."""
    from sonar.kernels.attention import AttentionMetadata

    # the package re-exports functions under some module names: import the modules themselves
    names = ["block_copy", "decode_attention", "kv_cache_write", "prefill_attention", "rms_norm", "silu_and_mul"]
    modules = [importlib.import_module(f"sonar.kernels.triton.{name}") for name in names]
    block_copy, decode_attention, kv_cache_write, prefill_attention, rms_norm, silu_and_mul = modules
    heads, kv_heads, dim, block, bf16 = 32, 8, 128, 16, torch.bfloat16
    cache = torch.zeros(2, 8, block, kv_heads, dim, dtype=bf16)
    cache8 = torch.zeros(2, 8, block, kv_heads, dim, dtype=torch.float8_e4m3fn)
    scale1, scale_h = torch.ones(1), torch.ones(kv_heads)
    decode_meta = AttentionMetadata.build([1, 1], [40, 70], [[0, 1, 2], [3, 4, 5, 6, 7]], block)
    prefill_meta = AttentionMetadata.build([20, 1], [40, 70], [[0, 1, 2], [3, 4, 5, 6, 7]], block)
    q1 = torch.zeros(2, heads, dim, dtype=bf16)
    qn = torch.zeros(21, heads, dim, dtype=bf16)
    kv = torch.zeros(21, kv_heads, dim, dtype=bf16)
    with recording(modules) as launches:
        for c, ks, vs in ((cache, None, None), (cache8, scale_h, scale_h)):
            kv_cache_write.write_kv_cache(kv, kv, c, prefill_meta.slot_mapping, ks, vs)
            for splits in (1, 4):
                decode_attention.paged_decode_attention(
                    q1, c, decode_meta.block_tables, decode_meta.seq_lens, 0.1, 70, None, ks, vs, num_splits=splits
                )
            prefill_attention.paged_prefill_attention(
                qn,
                c,
                prefill_meta.query_start_loc,
                prefill_meta.seq_lens,
                prefill_meta.block_tables,
                0.1,
                20,
                None,
                ks,
                vs,
            )
        kv_cache_write.write_kv_cache(kv, kv, cache8, prefill_meta.slot_mapping, scale1, scale1)
        decode_attention.paged_decode_attention(
            q1, cache, decode_meta.block_tables, decode_meta.seq_lens, 0.1, 70, 4096, num_splits=1
        )
        prefill_attention.paged_prefill_attention(
            qn, cache, prefill_meta.query_start_loc, prefill_meta.seq_lens, prefill_meta.block_tables, 0.1, 20, 4096
        )
        # SmolLM2-135M: 9 query heads on 3 KV heads (a group of 3), head_dim 64
        small = torch.zeros(2, 8, block, 3, 64, dtype=bf16)
        decode_attention.paged_decode_attention(
            torch.zeros(2, 9, 64, dtype=bf16),
            small,
            decode_meta.block_tables,
            decode_meta.seq_lens,
            0.1,
            70,
            num_splits=2,
        )
        prefill_attention.paged_prefill_attention(
            torch.zeros(21, 9, 64, dtype=bf16),
            small,
            prefill_meta.query_start_loc,
            prefill_meta.seq_lens,
            prefill_meta.block_tables,
            0.1,
            20,
        )
        x = torch.zeros(4, 4096, dtype=bf16)
        rms_norm.rms_norm(x, torch.ones(4096, dtype=bf16), 1e-6)
        rms_norm.rms_norm(x, torch.ones(4096, dtype=bf16), 1e-6, torch.zeros_like(x))
        rms_norm.rms_norm(qn, torch.ones(dim, dtype=bf16), 1e-6)  # per-head q norm
        silu_and_mul.silu_and_mul(torch.zeros(4, 2 * 14336, dtype=bf16))
        ids = torch.zeros(3, dtype=torch.int64)
        block_copy.copy_blocks(cache, cache, ids, ids)
        block_copy.copy_blocks(cache8, cache8, ids, ids)
    return launches


def compile_launch(launch: Launch, capability: int = 90, warp_size: int = 32) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, options = _signature(launch)
    source = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, warp_size), options=options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="CUDA compute capability, e.g. 90 or 80")
    parser.add_argument("--max-shared", type=int, default=227 * 1024, help="bytes of shared memory per block")
    args = parser.parse_args(argv)
    from sonar.kernels.triton._common import interpreting

    if interpreting():
        print("aot: unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failures = 0
    for launch in record_launches():
        consts = {k: v for k, v in launch.kwargs.items() if k.isupper()}
        label = f"{launch.name} " + " ".join(f"{k}={v}" for k, v in consts.items())
        start = time.perf_counter()
        try:
            compiled = compile_launch(launch, args.capability)
        except Exception as e:  # report every failure, then fail
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).strip()[:2000]}", flush=True)
            continue
        shared = compiled.metadata.shared
        ok = shared <= args.max_shared and "cubin" in compiled.asm
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: {time.perf_counter() - start:.1f}s shared={shared}B", flush=True)
    print(f"aot: {failures} failed" if failures else "aot: all kernels compiled", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
