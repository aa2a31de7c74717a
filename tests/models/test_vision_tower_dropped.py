"""A vision model loaded for a server that takes no pictures (an image limit of 0,
`load_model(pictures=False)`) holds only its language model: the tower's and projector's
parameter bytes are not there, the checkpoint's tower tensors are skipped, and the decoder's
weights are the same as a full load's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.models.loader import load_model
from tests.multimodal.tiny_gemma3 import save_tiny_gemma3
from tests.multimodal.tiny_llava import save_tiny_llava
from tests.multimodal.tiny_llava_next import save_tiny_llava_next
from tests.multimodal.tiny_qwen2_vl import save_tiny_qwen2_5_vl

FAMILIES: dict[str, Any] = {
    "llava": save_tiny_llava,
    "llava_next": save_tiny_llava_next,
    "qwen2_5_vl": save_tiny_qwen2_5_vl,
    "qwen3_vl": lambda path, seed: save_tiny_qwen2_5_vl(path, seed, family="qwen3_vl"),
    "gemma3": save_tiny_gemma3,
}


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_no_pictures_loads_no_tower(tmp_path: Path, family: str) -> None:
    FAMILIES[family](tmp_path, seed=1)
    full = load_model(str(tmp_path), dtype="float32").model
    text = load_model(str(tmp_path), dtype="float32", pictures=False).model
    tower = sum(parameter_bytes(getattr(full, name)) for name in type(full).tower_modules if name != "image_newline")
    tower += getattr(full, "image_newline", torch.empty(0)).nbytes
    assert tower > 0 and parameter_bytes(text) == parameter_bytes(full) - tower
    assert not any(hasattr(text, name) for name in type(full).tower_modules)
    kept = dict(text.named_parameters())
    for name, param in full.named_parameters():
        if name in kept:
            assert torch.equal(kept[name], param), name
