"""GPT-OSS's published MXFP4 safetensors layout (``quant_method: mxfp4``), written by the test: a
tiny random GPT-OSS whose experts are drawn as MXFP4 (random E2M1 codes and E8M0 exponents, so
the dequantized model is exact) and stored as ``<proj>_blocks`` / ``<proj>_scales`` beside plain
biases, one layer's experts kept plain through ``modules_to_not_convert``.

- the conversion equals transformers' ``convert_moe_packed_tensors`` on every code and exponent;
- transformers itself loads the checkpoint (dequantizing it on the CPU): it is the reference;
- Sonar serves the experts quantized (`QuantizedExperts`, the native MXFP4 kernel, 17 bytes per
  32 weights resident, no dense copy): greedy tokens equal, logits within 1e-4 (float32);
- ``--dequantize-weights`` gives the same tokens through the dense operator;
- through the engine: batched, chunked prefill (a 16-token budget, 4 sequences);
- refused, naming why: MXFP4 experts off the CPU without ``--dequantize-weights``, mxfp4 for
  another family, an experts module listed in ``modules_to_not_convert`` yet stored quantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar.models.errors import ModelLoadError
from sonar.models.gpt_oss import GptOssExperts
from sonar.models.loader import load_model
from sonar.models.moe import QuantizedExperts
from sonar.models.quantization import checkpoint_method
from sonar.models.quantization.mxfp4 import MXFP4
from tests.engine.conftest import save_word_tokenizer
from tests.models.against import assert_greedy_equals_transformers, transformers_greedy
from tests.models.test_gpt_oss import _hf, _prompts, tiny_config

NEW_TOKENS = 6
PLAIN_LAYER = 3
#: openai/gpt-oss-20b's list, and this test's plain experts
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
    f"model.layers.{PLAIN_LAYER}.mlp.experts",
]
#: E8M0 exponents drawn per projection: gate/up values up to 3, down up to 0.375
EXPONENTS = {"gate_up_proj": (125, 127), "down_proj": (122, 124)}


def _dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def _packed(shape: tuple[int, int, int], exponents: tuple[int, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    e, r, k = shape
    return {
        "blocks": torch.randint(0, 256, (e, r, k // 32, 16), generator=gen, dtype=torch.uint8),
        "scales": torch.randint(*exponents, (e, r, k // 32), generator=gen, dtype=torch.uint8),
    }


def write_mxfp4_checkpoint(path: Path) -> Any:
    """A tiny GPT-OSS in the published MXFP4 layout at `path` (with a word tokenizer), and
    transformers' model loaded from it (float32, eager attention)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    hf = _hf(tiny_config(intermediate_size=64), seed=5)  # whole 32-value groups in both projections
    c = hf.config
    hf.save_pretrained(str(path))
    save_word_tokenizer(path, c.vocab_size)
    (weights,) = path.glob("*.safetensors")
    state = load_file(str(weights))
    gen = torch.Generator().manual_seed(11)
    rows = {"gate_up_proj": (2 * c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size)}
    for i in range(c.num_hidden_layers):
        if i == PLAIN_LAYER:
            continue
        prefix = f"model.layers.{i}.mlp.experts"
        for proj, (r, k) in rows.items():
            del state[f"{prefix}.{proj}"]
            for kind, t in _packed((c.num_local_experts, r, k), EXPONENTS[proj], gen).items():
                state[f"{prefix}.{proj}_{kind}"] = t
    save_file(state, str(weights), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config))
    # Dequantized on load, as transformers does on a CPU without the `kernels` package; with it,
    # transformers would fetch its MXFP4 kernels from the hub.
    ref = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    ).eval()
    first = "model.layers.0.mlp.experts.gate_up_proj"
    expected = _dequantize(state[f"{first}_blocks"], state[f"{first}_scales"])
    assert torch.equal(ref.model.layers[0].mlp.experts.gate_up_proj, expected), "transformers read the MXFP4 experts"
    return ref


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The MXFP4 checkpoint and transformers' model loaded from it."""
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return path, write_mxfp4_checkpoint(path)


def test_the_conversion_equals_transformers_dequantization() -> None:
    """Every code and every exponent 0..254 (255 is E8M0's NaN), gate/up rows de-interleaved as
    Sonar's operator stacks them."""
    from sonar.kernels.quant import dequantize

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.arange(255, dtype=torch.uint8)[torch.randperm(255, generator=gen)[:24]].reshape(2, 6, 2)
    tensors = {"gate_up_proj_blocks": blocks, "gate_up_proj_scales": scales}
    tensors |= {"down_proj_blocks": blocks, "down_proj_scales": scales}
    want = _dequantize(blocks, scales)  # [E, K, R] as transformers' parameters
    method = MXFP4([])
    dense = dict(method.dequantized("m", tensors))
    assert torch.equal(dense["m.gate_up_proj"], want) and torch.equal(dense["m.down_proj"], want)
    layers = method.converted("m", tensors)
    for e in range(2):
        assert torch.equal(dequantize(layers[f"m.{e}.down_proj"]), want[e].T)
        assert torch.equal(dequantize(layers[f"m.{e}.gate_proj"]), want[e].T[0::2])
        assert torch.equal(dequantize(layers[f"m.{e}.up_proj"]), want[e].T[1::2])
        assert layers[f"m.{e}.gate_proj"].nbytes == 3 * 64 // 32 * 17


def test_experts_are_served_quantized_equal_to_transformers(checkpoint: tuple[Path, Any]) -> None:
    path, ref = checkpoint
    c = ref.config
    loaded = load_model(str(path), dtype="float32")
    assert loaded.quantization == "mxfp4"
    blocks = [layer.mlp.experts for layer in loaded.model.own_layers]
    quantized = [b for i, b in enumerate(blocks) if i != PLAIN_LAYER]
    assert all(isinstance(b, QuantizedExperts) for b in quantized), blocks
    assert isinstance(blocks[PLAIN_LAYER], GptOssExperts), "modules_to_not_convert: read plain"
    layer = quantized[0][0].gate_up_proj
    assert (layer.meta.format, layer.backend.name) == ("mxfp4", "native")
    weights = len(quantized) * c.num_local_experts * 3 * c.hidden_size * c.intermediate_size
    resident = sum(
        t.nbytes
        for experts in quantized
        for m in experts
        for t in [*m.gate_up_proj.packed.values(), *m.down_proj.packed.values()]
    )
    assert resident == weights // 32 * 17, "MXFP4's 17 bytes per 32 weights, not a dequantized copy"
    assert all(name.endswith("_bias") for b in quantized for name, _ in b.named_parameters(recurse=False))
    assert loaded.quantized is not None and loaded.quantized.formats == {
        "mxfp4": 2 * len(quantized) * c.num_local_experts
    }
    # 17 and 40 tokens: past the sliding window of 8
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(c.vocab_size)[1:3], NEW_TOKENS)
    assert all(b.is_stacked for b in quantized), "the grouped operator (sonar_cpu::moe_quant) served them"


def test_dequantize_weights_gives_the_same_tokens(checkpoint: tuple[Path, Any]) -> None:
    path, ref = checkpoint
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    assert loaded.quantization is None
    assert all(isinstance(layer.mlp.experts, GptOssExperts) for layer in loaded.model.own_layers)
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(ref.config.vocab_size)[2:3], 4)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_greedy_equals_transformers(checkpoint: tuple[Path, Any], anyio_backend: str) -> None:
    """Through `sonar.open`: four sequences batched, prompts chunked by a 16-token budget."""
    path, ref = checkpoint
    prompts = _prompts(ref.config.vocab_size)
    params = sonar.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    async with sonar.open(
        str(path), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=16, max_num_seqs=4
    ) as llm:
        outs = await llm.generate_many(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(ref, prompt, NEW_TOKENS)[0]


def test_mxfp4_for_another_family_is_refused() -> None:
    config = {"model_type": "llama", "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ModelLoadError, match="'mxfp4' is served for GPT-OSS .* not for model_type 'llama'"):
        checkpoint_method(config, None)


def test_a_module_not_to_convert_stored_quantized_is_refused(checkpoint: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = checkpoint
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (changed / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.*.mlp.experts"]
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.experts is in modules_to_not_convert"):
        load_model(str(changed), dtype="float32")
