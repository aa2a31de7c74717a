"""Reading PEFT adapter folders (`sonar.lora.adapter`): the factors and their scaling as peft
computes them, and every refusal with the reason named."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar.errors import LoRAError
from sonar.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, file_digest, read_adapter
from sonar.lora.limits import LoRALimits, ModelShapes
from tests.lora.conftest import Built


@pytest.fixture(scope="module")
def shapes(smollm2_hf: Any) -> ModelShapes:
    return ModelShapes.of_config(smollm2_hf.config)


def _tensors(built: Built) -> dict[str, torch.Tensor]:
    return load_file(str(built.path / WEIGHTS_FILE))


def _factor(tensors: dict[str, torch.Tensor], layer: int, module: str, half: str) -> torch.Tensor:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return tensors[f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{half}.weight"]


def test_factors_are_scaled_by_alpha_over_rank(smollm2_adapters: dict[str, Built], shapes: ModelShapes) -> None:
    built = smollm2_adapters["plain"]
    weights = read_adapter(built.path, shapes, LoRALimits(max_rank=16))
    tensors = _tensors(built)
    assert weights.rank == 8
    assert len(weights.factors) == 7 * shapes.num_layers
    a, b = weights.factors[(3, "gate_proj")]
    assert torch.equal(a, _factor(tensors, 3, "gate_proj", "A"))
    assert torch.allclose(b, _factor(tensors, 3, "gate_proj", "B") * (16 / 8))
    assert weights.digest == file_digest(built.path)


def test_rslora_and_per_module_ranks_and_alphas(smollm2_adapters: dict[str, Built], shapes: ModelShapes) -> None:
    built = smollm2_adapters["rslora"]
    weights = read_adapter(built.path, shapes, LoRALimits(max_rank=16))
    tensors = _tensors(built)
    scalings = {"down_proj": 8 / math.sqrt(4), "o_proj": 32 / math.sqrt(16), "q_proj": 8 / math.sqrt(16)}
    for module, scaling in scalings.items():
        a, b = weights.factors[(0, module)]
        assert a.shape[0] == (4 if module == "down_proj" else 16)
        assert torch.allclose(b, _factor(tensors, 0, module, "B") * scaling)


def test_an_adapter_must_fit_the_server_target_modules(smollm2_adapters: dict[str, Built], shapes: ModelShapes) -> None:
    attention = smollm2_adapters["attention"].path  # q, v and o
    weights = read_adapter(attention, shapes, LoRALimits(16, frozenset({"qkv_proj", "o_proj"})))
    assert {module for _, module in weights.factors} == {"q_proj", "v_proj", "o_proj"}
    with pytest.raises(LoRAError, match="layer 0 o_proj: the server applies adapters only to q_proj, v_proj"):
        read_adapter(attention, shapes, LoRALimits(16, frozenset({"q_proj", "v_proj"})))


def _copy(built: Built, tmp_path: Path) -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(built.path, folder)
    return folder


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps(config | changes))


def _edit_tensors(folder: Path, change: Any) -> None:
    tensors = load_file(str(folder / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: _edit_config(f, use_dora=True), "DoRA adapters (use_dora) are not supported"),
        (lambda f: _edit_config(f, bias="all"), "bias 'all' (trained biases) is not supported"),
        (lambda f: _edit_config(f, modules_to_save=["lm_head"]), "modules_to_save"),
        (lambda f: _edit_config(f, peft_type="PREFIX_TUNING"), "peft_type 'PREFIX_TUNING' is not supported"),
        (lambda f: _edit_config(f, r=0), "r must be a positive integer"),
        (lambda f: (f / CONFIG_FILE).unlink(), "has no adapter_config.json"),
        (lambda f: (f / CONFIG_FILE).write_text("{not json"), "cannot read"),
        (
            lambda f: (f / WEIGHTS_FILE).rename(f / "adapter_model.bin"),
            "adapter_model.bin is refused: unpickling it runs code from the file",
        ),
        (lambda f: (f / WEIGHTS_FILE).write_bytes(b"garbage"), "cannot read"),
        (
            lambda f: _edit_tensors(
                f, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)})
            ),
            "is not a LoRA factor of a supported projection",
        ),
        (
            lambda f: _edit_tensors(f, lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")),
            "layer 0 up_proj: lora_B is missing",
        ),
        (
            lambda f: _edit_tensors(
                f, lambda t: t.update({"base_model.model.model.layers.99.mlp.up_proj.lora_A.weight": torch.zeros(8, 4)})
            ),
            "is for layer 99; the base model has 30",
        ),
        (
            lambda f: _edit_tensors(
                f,
                lambda t: t["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].__setitem__(
                    (0, 0), float("nan")
                ),
            ),
            "non-finite values",
        ),
        (
            lambda f: _edit_tensors(
                f,
                lambda t: t.update(
                    {"base_model.model.model.layers.2.self_attn.k_proj.lora_A.weight": torch.zeros(8, 100)}
                ),
            ),
            "layer 2 k_proj: lora_A (8, 100) and lora_B (192, 8) do not fit the base model's projection (576 -> 192)",
        ),
        (lambda f: _edit_config(f, r=4), "layer 0 down_proj: rank 8, but adapter_config.json says 4"),
    ],
)
def test_refusals_name_the_reason(
    smollm2_adapters: dict[str, Built], shapes: ModelShapes, tmp_path: Path, edit: Any, message: str
) -> None:
    folder = _copy(smollm2_adapters["plain"], tmp_path)
    edit(folder)
    with pytest.raises(LoRAError) as caught:
        read_adapter(folder, shapes, LoRALimits(16))
    assert message in str(caught.value)


def test_a_rank_above_the_limit_is_refused(smollm2_adapters: dict[str, Built], shapes: ModelShapes) -> None:
    with pytest.raises(LoRAError, match="rank 16 exceeds --max-lora-rank 8"):
        read_adapter(smollm2_adapters["rslora"].path, shapes, LoRALimits(max_rank=8))


def test_not_a_folder(shapes: ModelShapes, tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="is not a directory"):
        read_adapter(tmp_path / "missing", shapes, LoRALimits())


def test_the_digest_follows_the_content_not_the_folder(smollm2_adapters: dict[str, Built], tmp_path: Path) -> None:
    built = smollm2_adapters["plain"]
    copy = _copy(built, tmp_path)
    assert file_digest(copy) == file_digest(built.path)
    _edit_config(copy, lora_alpha=17)
    assert file_digest(copy) != file_digest(built.path)
