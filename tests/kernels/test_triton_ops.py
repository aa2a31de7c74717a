"""``sonar.kernels.ops``: on CPU tensors, with the native kernels off, every function is the torch
reference, unchanged (the native kernels have their own tests in ``test_native.py``); and the
kernels these tests check really run on Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from sonar.kernels import ops, reference
from sonar.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache


def test_kernels_are_interpreted() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from sonar.kernels.triton import decode_attention, kv_cache_write

    assert isinstance(decode_attention._decode_split_kernel, InterpretedFunction)
    assert isinstance(kv_cache_write._kv_cache_write_kernel, InterpretedFunction)


def test_cpu_tensors_take_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_NATIVE_KERNELS", "0")
    assert ops.triton_available()
    x = torch.randn(3, 8)
    assert not ops.use_triton(x)
    gen = torch.Generator().manual_seed(0)

    weight = torch.randn(8, generator=gen)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))

    meta = AttentionMetadata.build([3, 1], [3, 6], [[2, 0], [1, 3]], 4)
    k, v = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    q = torch.randn(4, 4, 8, generator=gen)
    ours, theirs = torch.zeros(2, 4, 4, 2, 8), torch.zeros(2, 4, 4, 2, 8)
    ops.write_kv_cache(k, v, ours, meta.slot_mapping)
    write_kv_cache(k, v, theirs, meta.slot_mapping)
    assert torch.equal(ours, theirs)
    assert torch.equal(ops.paged_attention(q, ours, meta, 0.3), paged_attention(q, theirs, meta, 0.3))

    dst = torch.zeros(2, 2, 4, 2, 8)
    ops.copy_blocks(ours, dst, torch.tensor([3, 1]), torch.tensor([0, 1]))
    assert torch.equal(dst, ours[:, [3, 1]])


def test_ops_work_without_triton() -> None:
    """Where Triton cannot be imported (``sys.modules['triton'] = None`` makes every import of it
    fail), ``ops`` still imports and runs the references."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from sonar.kernels import ops, reference\n"
        "assert not ops.triton_available()\n"
        "x = torch.randn(2, 6)\n"
        "assert torch.equal(ops.silu_and_mul(x), reference.silu_and_mul(x))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "SONAR_NATIVE_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
