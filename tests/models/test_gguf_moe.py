"""GGUF mixture-of-experts files served with their experts quantized (`QuantizedExperts`): tiny
Mixtral / Qwen2-MoE / Qwen3-MoE models written by `tests.models.gguf_writer` in Q8_0 and Q4_0.

- exactness, float32: the quantized experts on the torch reference backend equal transformers on
  the dequantized weights (greedy tokens, logits within 1e-4), so the grouping by expert and the
  weighted sum are the fused operator's;
- as served (bfloat16, the native kernels): the experts' loaded bytes are the quants' (not
  bfloat16's), and every prompt token's logits lie within `QUANT_TOLERANCE` of the same file
  served with ``--dequantize-weights``, at 90 % of the positions at least: the int8 kernels
  quantize the activations, which can flip a router's near-tied top-k choice at a token (the
  tiny models have ties within 0.01 of probability), and that token's logits then move by more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.gguf_file import gguf_quantized_weights
from sonar.models.loader import load_model
from sonar.models.moe import QuantizedExperts, SparseMoeBlock
from sonar.models.quantized import install_quantized
from tests.models.against import assert_greedy_equals_transformers
from tests.models.driver import GreedyDriver
from tests.models.gguf_writer import write_gguf
from tests.models.test_gguf_families import _configs, _prompts, _reference

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
QUANT_TOLERANCE = 0.05
"""Against the dequantized bfloat16 serve: a fraction of the largest logit."""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SONAR_CACHE_ROOT", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    configs, out = _configs(), {}
    for i, name in enumerate(MOE):
        torch.manual_seed(200 + i)
        hf = AutoModelForCausalLM.from_config(configs[name], dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            for pname, param in hf.named_parameters():
                norm = pname.endswith("norm.weight")
                param.copy_((1.0 if norm else 0.0) + (0.2 if norm else 0.15) * torch.randn_like(param))
        out[name] = hf
    return out


def _qtype(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return getattr(GGMLQuantizationType, name)


def _blocks(model: Any) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", MOE)
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(
    name: str, qtype: str, models: dict[str, Any], tmp_path: Path
) -> None:
    hf = models[name]
    path = tmp_path / f"{name}-{qtype}.gguf"
    ref = _reference(hf, write_gguf(path, name, hf, _qtype(qtype)))
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    quantized, _ = gguf_quantized_weights(path, loaded.config)
    assert any(".mlp.experts.0.down_proj" in n for n in quantized)
    installed = install_quantized(loaded.model, loaded.model.shard_quantized(quantized), reference=True)
    assert all(isinstance(b.experts, QuantizedExperts) for b in _blocks(loaded.model))
    assert any(".experts.1.gate_up_proj" in n for n in installed.quantized)
    assert_greedy_equals_transformers(loaded.model, ref, _prompts(hf.config.vocab_size), 8)


@pytest.mark.parametrize(("name", "qtype", "ratio"), [("qwen3_moe", "Q8_0", 0.6), ("mixtral", "Q4_0", 0.4)])
def test_served_quantized_experts_take_the_quants_bytes_and_match_the_dequantized_serve(
    name: str, qtype: str, ratio: float, models: dict[str, Any], tmp_path: Path
) -> None:
    hf = models[name]
    path = tmp_path / f"{name}-{qtype}.gguf"
    write_gguf(path, name, hf, _qtype(qtype))
    served = load_model(str(path), dtype="bfloat16")
    dequantized = load_model(str(path), dtype="bfloat16", dequantize_weights=True)
    assert served.quantization == "gguf" and dequantized.quantization is None

    quants, _ = gguf_quantized_weights(path, served.config)
    expert_quants = sum(qw.nbytes for n, qw in quants.items() if ".mlp.experts." in n)
    blocks = _blocks(served.model)
    expert_bytes = sum(layer.nbytes for b in blocks for e in b.experts for layer in (e.gate_up_proj, e.down_proj))
    bf16_bytes = sum(
        2 * (b.experts.gate_up_proj.numel() + b.experts.down_proj.numel()) for b in _blocks(dequantized.model)
    )
    assert expert_bytes == expert_quants
    assert expert_bytes < ratio * bf16_bytes, (expert_bytes, bf16_bytes)
    assert not any(isinstance(b.experts, QuantizedExperts) for b in _blocks(dequantized.model))

    prompts = _prompts(hf.config.vocab_size)
    got = GreedyDriver(served.model, torch.bfloat16, num_blocks=64, block_size=4).generate(
        prompts, 6, prompt_logits=True
    )
    want = GreedyDriver(dequantized.model, torch.bfloat16, num_blocks=64, block_size=4).generate(
        prompts, 6, prompt_logits=True
    )
    errors = torch.cat([(a.float() - b.float()).abs().amax(-1) for a, b in zip(got.prompt_logits, want.prompt_logits)])
    scale = max(float(b.float().abs().max()) for b in want.prompt_logits)
    assert (errors < QUANT_TOLERANCE * scale).float().mean() >= 0.9, errors
    agree = sum(
        int(a.float().argmax(-1).eq(b.float().argmax(-1)).sum()) for a, b in zip(got.prompt_logits, want.prompt_logits)
    )
    assert agree >= 0.9 * errors.numel()
    assert all(b.experts.is_stacked for b in blocks), "the grouped operator (sonar_cpu::moe_quant) served them"


def test_a_block_with_some_experts_not_quantized_is_refused(models: dict[str, Any], tmp_path: Path) -> None:
    hf = models["qwen3_moe"]
    path = tmp_path / "q8.gguf"
    write_gguf(path, "qwen3_moe", hf, _qtype("Q8_0"))
    loaded = load_model(str(path), dtype="float32", dequantize_weights=True)
    quantized, _ = gguf_quantized_weights(path, loaded.config)
    del quantized["model.layers.0.mlp.experts.3.down_proj"]
    with pytest.raises(ModelLoadError, match=r"experts.3.down_proj is not.*--dequantize-weights"):
        install_quantized(loaded.model, quantized, reference=True)


def _meta_qwen3_moe(parallel: Any) -> Any:
    from sonar.models.qwen_moe import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return Qwen3MoeForCausalLM(_configs()["qwen3_moe"], parallel)


def _int8(rows: int, cols: int) -> Any:
    from sonar.kernels.quant import QuantizedWeight

    return QuantizedWeight("int8", torch.zeros(rows, cols, dtype=torch.int8), torch.ones(rows, cols // 32), None, 32)


def test_quantized_experts_are_refused_under_tensor_parallelism() -> None:
    from sonar.models.parallel import TensorParallel

    model = _meta_qwen3_moe(TensorParallel(rank=0, size=2))
    with pytest.raises(ModelLoadError, match=r"experts\.0\.gate_proj.*not split.*--dequantize-weights"):
        model.shard_quantized({"model.layers.0.mlp.experts.0.gate_proj": _int8(32, 64)})
