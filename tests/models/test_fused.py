"""The native layer loop for decode steps (`sonar.models.fused`) against the per-op path it replaces:
the same logits bit for bit and the same KV cache, on the real SmolLM2 weights with packed bf16
linears and on the tiny architectures (biases, sliding windows, float32, bfloat16)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sonar.kernels import linear, native
from sonar.kernels.attention import AttentionMetadata
from sonar.models.fused import FusedDecode, layer_weights
from sonar.models.loader import load_model
from tests.models.driver import GreedyDriver


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 21, 40, 9, 17)]


class Counting:
    """Counts the steps the native layer loop served; `off` makes every step take the per-op path."""

    def __init__(self, fused: FusedDecode, monkeypatch: pytest.MonkeyPatch, off: bool = False) -> None:
        self.calls = 0
        serves, run = fused.serves, fused.run

        def counted(*args: Any) -> torch.Tensor:
            self.calls += 1
            return run(*args)

        monkeypatch.setattr(fused, "run", counted)
        if off:
            monkeypatch.setattr(fused, "serves", lambda *args: False)
        else:
            monkeypatch.setattr(fused, "serves", serves)


def _both(
    model: Any, dtype: torch.dtype, prompts: list[list[int]], new: int, monkeypatch: pytest.MonkeyPatch, **kw: Any
) -> tuple[Any, Any, GreedyDriver, GreedyDriver, int]:
    on = Counting(model.fused_decode, monkeypatch)
    fused_driver = GreedyDriver(model, dtype, num_blocks=160, block_size=4)
    fused = fused_driver.generate(prompts, new, **kw)
    with monkeypatch.context() as m:
        Counting(model.fused_decode, m, off=True)
        per_op_driver = GreedyDriver(model, dtype, num_blocks=160, block_size=4)
        per_op = per_op_driver.generate(prompts, new, **kw)
    return fused, per_op, fused_driver, per_op_driver, on.calls


def _assert_same(fused: Any, per_op: Any, a: GreedyDriver, b: GreedyDriver) -> None:
    assert fused.tokens == per_op.tokens
    for x, y in zip(fused.logits, per_op.logits, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.kv_caches, b.kv_caches, strict=True):  # NaN marks the slots nobody wrote, in both
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))


@pytest.mark.parametrize("name", ["llama3", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_architectures_equal_the_per_op_path(
    name: str, dtype: str, tiny_checkpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Biases (Qwen2), a sliding window shorter than the prompts (Mistral), Llama 3 rope; plain
    ``nn.Linear`` weights through ``at::linear``; staggered joins so decode-only steps alternate
    with mixed ones."""
    loaded = load_model(str(tiny_checkpoints[name].path), dtype=dtype)
    assert layer_weights(loaded.model) is not None
    fused, per_op, a, b, calls = _both(
        loaded.model,
        loaded.dtype,
        _prompts(loaded.config.vocab_size),
        12,
        monkeypatch,
        prefill_chunk=8,
        join_steps=[0, 2, 0, 5, 1],
    )
    assert calls >= 8  # the decode-only steps
    _assert_same(fused, per_op, a, b)


def test_smollm2_packed_bf16_equals_the_per_op_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving configuration: SmolLM2's weights in bf16, linears packed for Sonar's kernel."""
    loaded = load_model(None, dtype="bfloat16")
    linear.prepack_linears(loaded.model)
    weights = layer_weights(loaded.model)
    if not linear.can_pack_native(loaded.model.lm_head.weight):  # oneDNN's packing: the per-op path
        assert weights is None
        return
    assert weights is not None and weights.packed
    fused, per_op, a, b, calls = _both(loaded.model, torch.bfloat16, _prompts(1000)[:4], 6, monkeypatch)
    assert calls == 5
    _assert_same(fused, per_op, a, b)


def test_what_the_loop_does_not_serve(tiny_checkpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's per-head q/k norms, prefill and mixed steps, a float8 cache, and the kernels turned
    off take the per-op path."""
    qwen3 = load_model(str(tiny_checkpoints["qwen3"].path), dtype="float32").model
    assert layer_weights(qwen3) is None
    model = load_model(str(tiny_checkpoints["llama3"].path), dtype="float32").model
    fused = model.fused_decode
    caches = GreedyDriver(model, torch.float32, num_blocks=8, block_size=4).kv_caches
    decode = AttentionMetadata.build([1, 1], [5, 3], [[0, 1], [2]], 4)
    assert fused.serves(caches, decode)
    prefill = AttentionMetadata.build([3], [3], [[0]], 4)
    mixed = AttentionMetadata.build([1, 2], [5, 2], [[0, 1], [2]], 4)
    assert not fused.serves(caches, prefill)
    assert not fused.serves(caches, mixed)
    fp8 = [c.to(torch.float8_e4m3fn) for c in caches]
    assert not fused.serves(fp8, decode)
    monkeypatch.setenv(native.ENV, "0")
    assert not fused.serves(caches, decode)


def test_repacked_weights_are_picked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PackedLinear.repack` after a weight change: the loop reads the new packing, not the old."""
    loaded = load_model(None, dtype="bfloat16")
    linear.prepack_linears(loaded.model)
    model = loaded.model
    before = model.fused_decode.weights()
    layer = model.model.layers[3].mlp.down_proj
    with torch.no_grad():
        layer.weight.mul_(0.5)
    layer.repack()
    after = model.fused_decode.weights()
    assert after is not before
    assert after.down[3] is layer.packed if after.packed else after.down[3] is layer.weight
