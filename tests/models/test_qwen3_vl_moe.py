"""Qwen3-VL MoE beyond what it shares with the other Qwen-VL families (`tests/models/test_qwen2_vl.py`
runs its logits, greedy tokens and tower against transformers'): its sparse and dense layers where
the config puts them, the published checkpoints' transposed expert tensors read into the same
parameters as transformers' own layout, and what it is not served with refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.errors import ModelLoadError
from sonar.models.loader import load_model
from sonar.models.moe import SparseMoeBlock
from tests.multimodal.tiny_qwen2_vl import save_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    return path, save_tiny_qwen2_5_vl(path, seed=7, family="qwen3_vl_moe")


def test_sparse_layers_are_where_the_config_puts_them_with_transformers_weights(tiny: tuple[Path, Any]) -> None:
    path, hf = tiny
    model = load_model(str(path), dtype="float32").model
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [True, False, True]
    block = model.model.layers[0].mlp
    assert block.spec.renormalize and block.shared_expert is None  # Qwen3-VL MoE's router, no shared expert
    ref = hf.model.language_model.layers[0].mlp
    assert torch.equal(block.experts.gate_up_proj, ref.experts.gate_up_proj)
    assert torch.equal(block.experts.down_proj, ref.experts.down_proj)
    assert torch.equal(block.gate.weight, ref.gate.weight)


def test_published_transposed_expert_tensors_load_the_same_weights(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    """The released checkpoints store ``experts.gate_up_proj`` ``[E, hidden, 2 I]`` and
    ``experts.down_proj`` ``[E, I, hidden]``; transformers' ``save_pretrained`` writes its
    in-memory ``[E, 2 I, hidden]`` / ``[E, hidden, I]``. Both load into the same parameters."""
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    state = load_file(str(path / "model.safetensors"))
    stacked = [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert len(stacked) == 4  # two sparse layers, two tensors each
    published = {k: v.transpose(1, 2).contiguous() if k in stacked else v for k, v in state.items()}
    assert tuple(published[stacked[0]].shape[1:]) in ((64, 96), (48, 64))
    save_file(published, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    ours = dict(load_model(str(tmp_path), dtype="float32").model.named_parameters())
    for name, value in load_model(str(path), dtype="float32").model.named_parameters():
        assert torch.equal(ours[name], value), name


def test_a_misshapen_expert_tensor_is_refused_naming_it(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, _ = tiny
    state = load_file(str(path / "model.safetensors"))
    name = "model.language_model.layers.0.mlp.experts.down_proj"
    state[name] = torch.zeros(4, 64, 40)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match=r"weight model\.layers\.0\.mlp\.experts\.down_proj has shape \(64, 40\)"):
        load_model(str(tmp_path), dtype="float32")


def test_parallelism_lora_and_eagle_are_refused_by_name(tiny: tuple[Path, Any]) -> None:
    from sonar.models.decoder import EAGLE, LORA, QUANTIZED
    from sonar.models.parallel import PipelineStage, TensorParallel
    from sonar.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

    path, _ = tiny
    with pytest.raises(ModelLoadError, match="Qwen3VLMoeForConditionalGeneration is not served with tensor parallel"):
        load_model(str(path), dtype="float32", parallel=TensorParallel(rank=0, size=2))
    with pytest.raises(ModelLoadError, match="not served with pipeline parallelism.*DeepStack"):
        load_model(str(path), dtype="float32", stage=PipelineStage(index=0, size=2))
    for feature, why in ((LORA, "mixture-of-experts"), (EAGLE, "mixture-of-experts"), (QUANTIZED, "Qwen3-VL MoE")):
        with pytest.raises(ModelLoadError, match=f"not served with {feature}: .*{why}"):
            Qwen3VLMoeForConditionalGeneration.require_support(feature)
