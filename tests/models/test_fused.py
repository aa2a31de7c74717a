"""The native layer loop for decode steps (`sonar.models.fused`) against the per-op path it replaces:
the same logits bit for bit and the same KV cache, on the real SmolLM2 weights with packed bf16
linears and on the tiny architectures (biases, sliding windows, float32, bfloat16), with LoRA
adapters on the linear layers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from sonar.kernels import linear, native
from sonar.kernels.attention import AttentionMetadata
from sonar.kernels.attention_op import step_metadata
from sonar.kernels.quant import QuantizedWeight
from sonar.kernels.quant_linear import QuantEmbedding, QuantLinear, ReferenceBackend
from sonar.models.fused import PACKED_BF16, PLAIN, QUANTIZED, FusedDecode, layer_weights
from sonar.models.loader import load_model
from sonar.models.lora import LoRAContext, LoRALinear
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
    loaded = load_model(None, dtype="bfloat16", dequantize_weights=True)
    packed = linear.prepack_linears(loaded.model)
    weights = layer_weights(loaded.model)
    if packed and not linear.can_pack_native(loaded.model.lm_head.weight):  # oneDNN's packing: the per-op path
        assert weights is None
        return
    # packed for Sonar's kernel, or (a CPU that packs bfloat16 for neither) plain matrices
    assert weights is not None and set(weights.kinds) == {PACKED_BF16 if packed else PLAIN}
    fused, per_op, a, b, calls = _both(loaded.model, torch.bfloat16, _prompts(1000)[:4], 6, monkeypatch)
    assert calls == 5
    _assert_same(fused, per_op, a, b)


def test_smollm2_packed_bf16_at_many_rows_equals_the_per_op_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of 20 rows: the native kernel (on a CPU with AMX its tile path, from
    `linear.amx_rows` rows) in the loop as in the per-op path; bit for bit."""
    loaded = load_model(None, dtype="bfloat16", dequantize_weights=True)
    linear.prepack_linears(loaded.model)
    weights = layer_weights(loaded.model)
    if weights is None or PACKED_BF16 not in weights.kinds:  # no AVX512-BF16: nothing is packed natively
        return
    rows = 20
    assert linear.amx_rows() <= rows
    prompts = [p[:6] for p in _prompts(1000)] * -(-rows // 5)
    fused, per_op, a, b, calls = _both(loaded.model, torch.bfloat16, prompts[:rows], 3, monkeypatch)
    assert calls == 2
    _assert_same(fused, per_op, a, b)


def test_smollm2_served_quantized_equals_the_per_op_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default serving configuration: the embedded GGUF's quants (int4 layers, the int8 tied
    output layer) through the native loop, bit for bit the per-op path."""
    loaded = load_model(None, dtype="bfloat16")
    if not native.available():
        return
    weights = layer_weights(loaded.model)
    assert weights is not None and all(kind >= QUANTIZED for kind in weights.kinds)
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
    loaded = load_model(None, dtype="bfloat16", dequantize_weights=True)
    model = loaded.model
    if not linear.prepack_linears(model):  # a CPU that packs bfloat16 for neither kernel
        assert type(model.model.layers[3].mlp.down_proj) is nn.Linear
        return
    before = model.fused_decode.weights()
    layer = model.model.layers[3].mlp.down_proj
    with torch.no_grad(), linear.materialized(model):  # as a weight update writes
        layer.weight.mul_(0.5)
        layer.repack()
    after = model.fused_decode.weights()
    assert after is not before
    assert after.down[3] is (layer.packed if after.kinds[4 * 3 + 3] == PACKED_BF16 else layer.weight)


# --- quantized linear layers ---------------------------------------------------------------------


def _quantize(weight: torch.Tensor, fmt: str, group: int, offsets: bool) -> QuantizedWeight:
    """Round-to-nearest quantization of `weight` ``[N, K]`` in groups of `group` columns: int4
    from the group's minimum (GGUF's Q4_1 with offsets, Q4_0-like without), int8 and fp8
    symmetric (around the group's midpoint, as the offset, if `offsets`)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1), w.amax(-1)
    if fmt == "int4":
        base = low if offsets else torch.zeros_like(low)
        scale = ((high - base) / 15).clamp_min(1e-8)
        values = ((w - base[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return QuantizedWeight("int4", values.reshape(n, k), scale, base if offsets else None, group)
    middle = (low + high) / 2 if offsets else torch.zeros_like(low)
    centered = w - middle[..., None]
    peak = centered.abs().amax(-1).clamp_min(1e-8)
    if fmt == "int8":
        scale = peak / 127
        values = (centered / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    else:
        scale = peak / 448
        values = (centered / scale[..., None]).to(torch.float8_e4m3fn)
    return QuantizedWeight(fmt, values.reshape(n, k), scale, middle if offsets else None, group)


def _quantized_model(path: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A tiny checkpoint in `dtype` with every linear layer quantized, formats mixed as a GGUF
    Q4_K_M file mixes them, and its tied output layer in int8 serving the embedding too."""
    loaded = load_model(str(path), dtype=str(dtype).removeprefix("torch."))
    model = loaded.model
    plan = {"qkv_proj": ("int4", 32, True), "o_proj": ("fp8", 64, False), "gate_up_proj": ("int4", 16, False)}
    plan["down_proj"] = ("int8", 32, False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, (fmt, group, offsets) in plan.items():
                if hasattr(parent, name):
                    old = getattr(parent, name)
                    qw = _quantize(old.weight.detach(), fmt, group, offsets)
                    bias = None if old.bias is None else old.bias.detach()
                    setattr(parent, name, QuantLinear(qw, bias))
        plan["o_proj"] = ("int8", 64, True)  # the next layers: another format in the same slot
    head = QuantLinear(_quantize(model.lm_head.weight.detach(), "int8", 32, False), None)
    model.lm_head = head
    model.model.embed_tokens = QuantEmbedding(head, dtype)
    return loaded


@pytest.mark.parametrize(
    ("name", "dtype"), [("llama3", torch.bfloat16), ("qwen2", torch.bfloat16), ("llama3", torch.float32)]
)
def test_quantized_layers_equal_the_per_op_path(
    name: str, dtype: torch.dtype, tiny_checkpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """int4 (with and without offsets), int8 and fp8 layers, several group sizes, biases (Qwen2),
    through ``linear_quant`` in the loop and in the layers: the same bits, in bfloat16 and in
    float32 (what ``--dtype auto`` serves on an AVX2-only CPU)."""
    loaded = _quantized_model(tiny_checkpoints[name].path, dtype)
    weights = layer_weights(loaded.model)
    assert weights is not None
    # int4 with offsets, fp8, int4, int8; then int8 with offsets in the second layer's o_proj
    assert weights.kinds[:8] == [QUANTIZED + 1, QUANTIZED + 4, QUANTIZED, QUANTIZED + 2] + [
        QUANTIZED + 1,
        QUANTIZED + 3,
        QUANTIZED,
        QUANTIZED + 2,
    ]
    assert weights.groups[:4] == [32, 64, 16, 32]
    fused, per_op, a, b, calls = _both(
        loaded.model,
        dtype,
        _prompts(loaded.config.vocab_size),
        10,
        monkeypatch,
        prefill_chunk=8,
        join_steps=[0, 2, 0, 5, 1],
    )
    assert calls >= 6
    _assert_same(fused, per_op, a, b)


def test_quantized_layers_the_loop_does_not_serve(tiny_checkpoints: dict[str, Any]) -> None:
    """An act-order permutation, the reference backend, and a float16 model with quantized layers
    (the kernel takes bfloat16 and float32 x) take the per-op path."""
    path = tiny_checkpoints["llama3"].path
    loaded = _quantized_model(path)
    layer = loaded.model.model.layers[1].mlp
    qw = _quantize(torch.randn(layer.down_proj.out_features, layer.down_proj.in_features), "int4", 32, True)
    layer.down_proj = QuantLinear(replace(qw, perm=torch.randperm(qw.in_features)), None)
    assert layer_weights(loaded.model) is None
    layer.down_proj = QuantLinear(qw, None, backend=ReferenceBackend())
    assert layer_weights(loaded.model) is None
    layer.down_proj = QuantLinear(qw, None)
    assert layer_weights(loaded.model) is not None
    model16 = load_model(str(path), dtype="float16").model
    model16.model.layers[0].mlp.down_proj = QuantLinear(qw, None)
    assert layer_weights(model16) is None


# --- LoRA adapters -------------------------------------------------------------------------------


def _with_adapters(model: Any, slots: int, rank: int, dtype: torch.dtype, seed: int) -> LoRAContext:
    """Wrap every linear layer of the decoder in a `LoRALinear` whose slots hold random adapters
    (deltas a tenth of the base outputs' size), all sharing the returned context."""
    gen = torch.Generator().manual_seed(seed)
    context = LoRAContext(torch.device("cpu"))
    hidden = model.config.hidden_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plan = {
            (attn, "qkv_proj"): (hidden, (attn.q_size, attn.kv_size, attn.kv_size)),
            (attn, "o_proj"): (attn.q_size, (hidden,)),
            (mlp, "gate_up_proj"): (hidden, (mlp.intermediate, mlp.intermediate)),
            (mlp, "down_proj"): (mlp.intermediate, (hidden,)),
        }
        for (parent, name), (in_features, splits) in plan.items():
            wrapped = LoRALinear(getattr(parent, name), in_features, splits, slots, rank, dtype, context)
            wrapped.a.copy_(torch.randn(wrapped.a.shape, generator=gen) / in_features**0.5)
            wrapped.b.copy_(0.1 * torch.randn(wrapped.b.shape, generator=gen) / rank**0.5)
            setattr(parent, name, wrapped)
    return context


def _decode_step(model: Any, dtype: torch.dtype, seqs: int) -> tuple[Tensor, Tensor, list[Tensor], AttentionMetadata]:
    """One decode step of `seqs` sequences over a cache of random keys and values."""
    gen = torch.Generator().manual_seed(3)
    caches = GreedyDriver(model, dtype, num_blocks=32, block_size=4).kv_caches
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    lens = [5 + 3 * i for i in range(seqs)]
    tables = [list(range(6 * i, 6 * i + -(-n // 4))) for i, n in enumerate(lens)]
    meta = AttentionMetadata.build([1] * seqs, lens, tables, 4)
    ids = torch.randint(1, model.config.vocab_size, (seqs,), generator=gen)
    return ids, torch.tensor([n - 1 for n in lens]), caches, meta


@pytest.mark.parametrize(("name", "dtype", "packed"), [("llama3", "float32", False), ("qwen2", "bfloat16", True)])
def test_lora_layers_equal_the_per_op_path(
    name: str, dtype: str, packed: bool, tiny_checkpoints: dict[str, Any]
) -> None:
    """Every linear wrapped in a `LoRALinear` (plain ``nn.Linear`` bases in float32; bf16 bases
    packed for ``linear_bf16``, with Qwen2's biases): the native loop adds the adapters of each
    row's slot (rows of the base model mixed in) bit for bit as the per-op path does."""
    loaded = load_model(str(tiny_checkpoints[name].path), dtype=dtype)
    model = loaded.model
    if packed:
        linear.prepack_linears(model)
    context = _with_adapters(model, slots=3, rank=8, dtype=loaded.dtype, seed=4)
    weights = layer_weights(model)
    assert weights is not None and weights.lora_context is context
    assert len(weights.lora_a) == 4 * model.num_layers and all(a.numel() for a in weights.lora_a)
    if packed:
        assert set(weights.kinds) == {PACKED_BF16} or not linear.can_pack_native(model.lm_head.weight)
    ids, positions, caches, meta = _decode_step(model, loaded.dtype, 5)
    fused = model.fused_decode
    outputs = {}
    for slots in ([2, -1, 0, 1, 0], [-1] * 5):
        with torch.inference_mode(), context.step(slots):
            assert fused.serves(caches, meta)
            fused_caches = [c.clone() for c in caches]
            got = fused.run(ids, positions, fused_caches, meta)
            per_op_caches = [c.clone() for c in caches]
            with step_metadata(meta):
                want = model.forward_tensors(ids, positions, per_op_caches)
        assert torch.equal(got, want)
        for x, y in zip(fused_caches, per_op_caches, strict=True):
            assert torch.equal(x, y)
        outputs[tuple(slots)] = got
    with_adapters, without = outputs.values()
    assert torch.equal(with_adapters[1], without[1])  # the row of the base model: no delta
    for row in (0, 2, 3, 4):
        assert not torch.equal(with_adapters[row], without[row])


def test_lora_layers_the_loop_does_not_serve(tiny_checkpoints: dict[str, Any]) -> None:
    """Adapters in another dtype than the model's (``--lora-dtype``) or sub-projections other
    than the model's take the per-op path; one layer wrapped of four is served."""
    path = str(tiny_checkpoints["llama3"].path)
    model = load_model(path, dtype="bfloat16").model
    _with_adapters(model, slots=2, rank=4, dtype=torch.float32, seed=1)
    assert layer_weights(model) is None
    model = load_model(path, dtype="float32").model
    context = _with_adapters(model, slots=2, rank=4, dtype=torch.float32, seed=1)
    attn = model.model.layers[0].self_attn
    attn.qkv_proj.splits = (attn.q_size + attn.kv_size, attn.kv_size)
    assert layer_weights(model) is None
    model = load_model(path, dtype="float32").model
    mlp = model.model.layers[1].mlp
    hidden = (model.config.hidden_size,)
    mlp.down_proj = LoRALinear(mlp.down_proj, mlp.intermediate, hidden, 2, 4, torch.float32, context)
    weights = layer_weights(model)
    assert weights is not None and [a.numel() > 0 for a in weights.lora_a] == [False] * 7 + [True]
