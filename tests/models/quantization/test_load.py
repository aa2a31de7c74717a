"""Whole quantized checkpoints through Sonar: a tiny random Llama whose linear layers are
quantized in the test (each format's own formula and packing), saved as safetensors with the
format's ``quantization_config``, loaded by `load_quantized_checkpoint`, against transformers'
LlamaForCausalLM holding the same layers' dequantized weights.

Tolerance: both sides compute in float32 from the same dequantized weights (Sonar's layers
dequantize the logical layout exactly); they differ only in kernels and summation order, as in
tests/models/test_architectures.py: 1e-4.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from sonar.kernels.quant import dequantize
from sonar.kernels.quant_linear import QuantLinear
from sonar.models.decoder import DecoderForCausalLM
from sonar.models.errors import ModelLoadError
from sonar.models.quantization import checkpoint_method, load_quantized_checkpoint, quantize_dynamic_fp8
from tests.models.driver import GreedyDriver
from tests.models.quantization import formats as f

ATOL = RTOL = 1e-4
NEW_TOKENS = 6
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# modules reading the same input share GPTQ's act-order (the same Hessian orders their columns;
# Mixtral's w1 / w3 are an expert's gate / up)
INPUT_OF = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "gate_proj": 2, "up_proj": 2, "w1": 2, "w3": 2}

Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _seed(module: str, shared: bool = True) -> int:
    """A layer's act-order seed: `shared`, one per layer, expert and input (q/k/v alike, an
    expert's gate/up alike); otherwise one per module."""
    layer = int(module.split(".")[2]) if module.startswith("model.layers.") else len(LINEARS)
    expert = re.search(r"\.experts\.(\d+)\.", module)
    leaf = module.rsplit(".", 1)[-1]
    own = next((i for i, name in enumerate(LINEARS) if name.endswith(leaf)), len(LINEARS))
    base = 100 * layer + 10_000 * (int(expert[1]) + 1 if expert else 0)
    return base + (INPUT_OF[leaf] if shared and leaf in INPUT_OF else 10 + own)


def _fp8_static(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    tensors, ref = f.fp8_scaled(w, per_row=False)
    return {**tensors, "input_scale": torch.tensor(0.03)}, ref


def _ct_fp8(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    return f.fp8_scaled(w, per_row=True)


TOKEN_ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
CASES: dict[str, tuple[Quantizer, dict, bool]] = {
    # name: (quantize one linear, quantization_config, lm_head quantized too)
    "gptq-int4-act-order-v1": (
        lambda m, w: f.gptq(w, 4, 32, False, True, True, seed=_seed(m)),
        f.gptq_config(4, 32, False, True, True),
        False,
    ),
    "gptq-int8-sym-v2": (
        lambda m, w: f.gptq(w, 8, 64, True, False, False),
        f.gptq_config(8, 64, True, False, False),
        True,
    ),
    "awq": (lambda m, w: f.awq(w, 64), f.awq_config(64), False),
    "fp8-block": (lambda m, w: f.fp8_block(w, (128, 128)), f.fp8_config((128, 128)), False),
    "fp8-tensor-static": (_fp8_static, f.fp8_config(None, static=True), False),
    "ct-w4a16": (
        lambda m, w: f.ct_packed(w, 4, 32, False),
        f.ct_config("pack-quantized", f.ct_weights(4, "int", "group", False, 32), ["lm_head"]),
        False,
    ),
    "ct-w8a8-fp8": (
        _ct_fp8,
        f.ct_config(
            "float-quantized", f.ct_weights(8, "float", "channel"), ["lm_head"], {**TOKEN_ACTS, "type": "float"}
        ),
        False,
    ),
    "ct-w8a8-int8": (
        lambda m, w: f.ct_int8(w, True),
        f.ct_config("int-quantized", f.ct_weights(8, "int", "channel"), [], TOKEN_ACTS),
        True,
    ),
}


def _tiny(tmp_path_factory: pytest.TempPathFactory, architecture: str, **extra: Any) -> tuple[Any, Path]:
    """A random 2-layer model (hidden 128, intermediate 256: every group size divides), saved plain."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        extra.pop("model_type"),
        vocab_size=384,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        architectures=[architecture],
        **extra,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # spread every weight (zero-initialized biases and unit norms too)
        for name, param in hf.named_parameters():
            param.copy_(
                1 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight") else 0.15 * torch.randn_like(param)
            )
    path = tmp_path_factory.mktemp(architecture)
    hf.save_pretrained(str(path))
    return hf, path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    return _tiny(tmp_path_factory, "LlamaForCausalLM", model_type="llama")


def _quantized_modules(hf: Any, with_lm_head: bool) -> list[str]:
    names = [f"model.layers.{i}.{linear}" for i in range(hf.config.num_hidden_layers) for linear in LINEARS]
    return names + (["lm_head"] if with_lm_head else [])


def _write(hf: Any, out: Path, quantize: Quantizer, qc: dict, with_lm_head: bool) -> dict[str, torch.Tensor]:
    """Save `hf` with its linear layers quantized; returns the dequantized weights by parameter name."""
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    return write_quantized(state, hf.config.to_dict(), _quantized_modules(hf, with_lm_head), out, quantize, qc)


def write_quantized(
    state: dict[str, torch.Tensor], config: dict, modules: list[str], out: Path, quantize: Quantizer, qc: dict
) -> dict[str, torch.Tensor]:
    """Save checkpoint `state` with `modules` quantized and `qc` as the config's
    ``quantization_config``; returns the dequantized weights by checkpoint name."""
    state = dict(state)
    dequantized = {}
    for module in modules:
        tensors, ref = quantize(module, state.pop(f"{module}.weight"))
        state.update({f"{module}.{part}": t.contiguous() for part, t in tensors.items()})
        dequantized[f"{module}.weight"] = ref
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return dequantized


def _reference(hf: Any, dequantized: dict[str, torch.Tensor]) -> Any:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32).eval()
    ref.load_state_dict({**hf.state_dict(), **dequantized})
    return ref


def _load(
    path: Path, requested: str | None = None, dequantize_weights: bool = False, dtype: torch.dtype = torch.float32
) -> DecoderForCausalLM:
    """The loader's steps: the model built on the meta device, then the checkpoint."""
    from transformers import AutoConfig

    from sonar.models.registry import model_class

    raw = json.loads((path / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(dtype=dtype).to_empty(device="cpu")
    if model.tie_word_embeddings:  # to_empty made two tensors of the tied one
        model.lm_head.weight = model.model.embed_tokens.weight
    method = checkpoint_method(raw, requested)
    assert method is not None
    load_quantized_checkpoint(model, path, method, f"test {path.name}", dequantize_weights=dequantize_weights)
    return model.eval().requires_grad_(False)


def _compare(model: DecoderForCausalLM, ref: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 19)]
    out = GreedyDriver(model, torch.float32, num_blocks=64, block_size=4).generate(
        prompts, NEW_TOKENS, prompt_logits=True
    )
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            full = ref(torch.tensor([prompt + out.tokens[i]])).logits[0].float()
        n = len(prompt)
        torch.testing.assert_close(out.prompt_logits[i], full[:n], atol=ATOL, rtol=RTOL)
        # each generated token's logits: the reference's at the position before it
        torch.testing.assert_close(out.logits[i], full[n - 1 : n - 1 + NEW_TOKENS], atol=ATOL, rtol=RTOL)
        assert out.tokens[i] == full[n - 1 : n - 1 + NEW_TOKENS].argmax(-1).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_the_dequantized_weights(
    case: str, tiny: tuple[Any, Path], tmp_path: Path
) -> None:
    hf, _ = tiny
    quantize, qc, with_lm_head = CASES[case]
    dequantized = _write(hf, tmp_path / case, quantize, qc, with_lm_head)
    model = _load(tmp_path / case)
    layers = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    fused = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    assert layers == {f"model.layers.{i}.{x}" for i in range(2) for x in fused} | (
        {"lm_head"} if with_lm_head else set()
    )
    _compare(model, _reference(hf, dequantized))


@pytest.mark.parametrize("case", ["gptq-int4-act-order-v1", "awq", "fp8-block", "ct-w8a8-int8"])
def test_served_in_bfloat16(case: str, tiny: tuple[Any, Path], tmp_path: Path) -> None:
    """The serving dtype, on whichever backend serves the layers: the prompt logits within 0.5 of
    transformers' float32 on the dequantized weights (0.75 for int8 weights, whose CPU kernel also
    rounds the activations to int8 per group, llama.cpp's way: measured up to 0.52). bfloat16
    activations through two layers move these logits (magnitude about 7) by up to about 0.25; a
    layer read in the wrong column or group order moves them by whole units."""
    hf, _ = tiny
    quantize, qc, with_lm_head = CASES[case]
    dequantized = _write(hf, tmp_path, quantize, qc, with_lm_head)
    model = _load(tmp_path, dtype=torch.bfloat16)
    ref = _reference(hf, dequantized)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 19)]
    out = GreedyDriver(model, torch.bfloat16, num_blocks=64, block_size=4).generate(prompts, 1, prompt_logits=True)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            full = ref(torch.tensor([prompt])).logits[0].float()
        atol = 0.75 if case == "ct-w8a8-int8" else 0.5
        torch.testing.assert_close(out.prompt_logits[i].float(), full, atol=atol, rtol=0)


def test_biases_and_tied_embeddings(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Qwen2 (biases on q/k/v, kept beside the quantized weights) with tied input and output
    embeddings (the output layer stays the embedding), as GPTQ act-order."""
    hf, _ = _tiny(tmp_path_factory, "Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=True)
    quantize, qc, _ = CASES["gptq-int4-act-order-v1"]
    dequantized = _write(hf, tmp_path, quantize, qc, False)
    model = _load(tmp_path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.bias is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _compare(model, _reference(hf, dequantized))


def test_dequantize_weights_serves_the_same_model_unquantized(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    hf, _ = tiny
    quantize, qc, with_lm_head = CASES["gptq-int4-act-order-v1"]
    dequantized = _write(hf, tmp_path, quantize, qc, with_lm_head)
    model = _load(tmp_path, dequantize_weights=True)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    _compare(model, _reference(hf, dequantized))


def test_dynamic_fp8_of_a_plain_checkpoint(tiny: tuple[Any, Path]) -> None:
    """``--quantization fp8`` on the unquantized checkpoint: its linear layers per output row,
    the output layer as it is."""
    hf, path = tiny
    model = _load(path, "fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.meta.format == "fp8"
    assert not isinstance(model.lm_head, QuantLinear)
    dequantized = {
        f"{m}.weight": dequantize(quantize_dynamic_fp8(hf.get_parameter(f"{m}.weight").detach()))
        for m in _quantized_modules(hf, False)
    }
    _compare(model, _reference(hf, dequantized))


def test_act_orders_that_differ_within_a_fused_layer_are_served_dequantized(
    tiny: tuple[Any, Path], tmp_path: Path
) -> None:
    """q, k and v with different act-orders cannot share one quantized matrix: the fused layer is
    served dequantized (exact), the others quantized, the logits as before."""
    hf, _ = tiny

    def quantize(module: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        return f.gptq(w, 4, 64, True, True, True, seed=_seed(module, shared=False))

    dequantized = _write(hf, tmp_path / "mixed", quantize, f.gptq_config(4, 64, True, True, True), False)
    model = _load(tmp_path / "mixed")
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)
    _compare(model, _reference(hf, dequantized))


def _gptq_checkpoint(hf: Any, out: Path) -> None:
    _write(hf, out, lambda m, w: f.gptq(w, 4, 64, True, False, True), f.gptq_config(4, 64, True, False, True), False)


def _edit(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    change(state)
    save_file(state, str(path / "model.safetensors"))


def test_sharded_checkpoint_with_modules_split_across_shards(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    """Shards named by ``model.safetensors.index.json``, every tensor in turn in the other shard,
    so each quantized module's parts arrive from two files."""
    from safetensors.torch import load_file

    hf, _ = tiny
    quantize, qc, with_lm_head = CASES["awq"]
    dequantized = _write(hf, tmp_path, quantize, qc, with_lm_head)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, name in enumerate(sorted(state)):
        shards[i % 2][name] = state[name]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(shard, str(tmp_path / file))
        weight_map.update(dict.fromkeys(shard, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    split = "model.layers.0.mlp.down_proj"
    assert len({weight_map[f"{split}.{part}"] for part in ("qweight", "qzeros", "scales")}) == 2
    _compare(_load(tmp_path), _reference(hf, dequantized))


def test_a_missing_part_names_the_source_and_module(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    _gptq_checkpoint(tiny[0], tmp_path)
    _edit(tmp_path, lambda s: s.pop("model.layers.1.mlp.down_proj.qzeros"))
    with pytest.raises(
        ModelLoadError, match=f"test {tmp_path.name}: quantized module model.layers.1.mlp.down_proj lacks its qzeros"
    ):
        _load(tmp_path)


def test_a_missing_plain_weight_is_named(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    _gptq_checkpoint(tiny[0], tmp_path)
    _edit(tmp_path, lambda s: s.pop("model.norm.weight"))
    with pytest.raises(ModelLoadError, match="checkpoint lacks weights for model.norm.weight"):
        _load(tmp_path)


def test_a_config_without_quantized_layers_is_refused(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    hf, path = tiny
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": f.awq_config(64)}))
    with pytest.raises(ModelLoadError, match="quantization method awq, but the checkpoint stores no layer quantized"):
        _load(tmp_path)


def test_fp8_weights_without_scales_are_refused(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    """An FP8 layer the config's method does not cover is not cast silently to the model's dtype."""
    _write(tiny[0], tmp_path, lambda m, w: f.fp8_block(w, (128, 128)), f.fp8_config((128, 128)), False)
    _edit(tmp_path, lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.up_proj.weight is stored as torch.float8_e4m3fn"):
        _load(tmp_path)


def test_a_quantized_embedding_is_refused(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    _gptq_checkpoint(tiny[0], tmp_path)

    def quantize_embedding(state: dict[str, torch.Tensor]) -> None:
        tensors, _ = f.gptq(state.pop("model.embed_tokens.weight"), 4, 64, True, False, True)
        state.update({f"model.embed_tokens.{k}": v for k, v in tensors.items()})

    _edit(tmp_path, quantize_embedding)
    with pytest.raises(ModelLoadError, match="model.embed_tokens is stored quantized; Sonar serves quantized linear"):
        _load(tmp_path)


def test_load_model_reads_the_method_from_the_checkpoint(tiny: tuple[Any, Path], tmp_path: Path) -> None:
    """Through `load_model` (what `sonar serve` calls): the method comes from config.json, the flag
    may name it or contradict it (an error naming both), and random dummy weights refuse it."""
    from sonar.models.loader import load_model

    hf, _ = tiny
    path = tmp_path / "gptq"
    _gptq_checkpoint(hf, path)
    loaded = load_model(str(path), dtype="bfloat16")
    assert loaded.quantization == "gptq" and loaded.quantized.formats == {"int4": 4 * hf.config.num_hidden_layers}
    assert load_model(str(path), dtype="bfloat16", quantization="gptq").quantization == "gptq"
    with pytest.raises(ModelLoadError, match="awq"):
        load_model(str(path), dtype="bfloat16", quantization="awq")
    with pytest.raises(ModelLoadError, match="dummy"):
        load_model(str(path), load_format="dummy")
    plain = load_model(str(path), dtype="bfloat16", dequantize_weights=True)
    assert plain.quantization is None and plain.quantized is None
    assert isinstance(plain.model.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)
    for requested in (None, "gptq"):  # the CPU's quantized kernels take float32 activations too
        served = load_model(str(path), dtype="float32", quantization=requested)
        assert served.quantization == "gptq" and served.dtype == torch.float32
