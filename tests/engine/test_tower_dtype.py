"""A bfloat16 vision model on CPU runs its tower and projector in float32, and is given them in
float32 at load (`sonar.models.loader.tower_in_float32`), not at its first image: after the
worker's `ModelRunner` is built every tower parameter has the dtype the forward uses, and the
first image request converts no parameter (each one's dtype and storage the same before and
after it), so the first image costs what any new image does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import ExecuteStep, NewRequestData
from sonar.sampling_params import SamplingParams
from tests.multimodal.tiny_llava import IMAGE_TOKEN_ID, random_image, save_tiny_llava
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, save_tiny_qwen2_5_vl

FAMILIES: dict[str, tuple[Any, int]] = {
    "llava": (save_tiny_llava, IMAGE_TOKEN_ID),  # encode_images (Gemma 3 and LLaVA-NeXT: the same path)
    "qwen2_5_vl": (save_tiny_qwen2_5_vl, IMAGE_PAD),  # encode_grid (every Qwen-VL family)
}


def storage(model: torch.nn.Module) -> dict[str, tuple[torch.dtype, int]]:
    return {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tower_is_float32_from_load_and_the_first_image_converts_nothing(
    one_thread: None, tmp_path: Path, family: str
) -> None:
    save, image_token = FAMILIES[family]
    save(tmp_path, seed=2)
    runner = ModelRunner(EngineConfig.from_args(str(tmp_path), dtype="bfloat16", num_gpu_blocks_override=16))
    model = runner.model
    tower = {f"{name}." for name in type(model).tower_modules}
    before = storage(model)
    assert {dtype for name, (dtype, _) in before.items() if name.startswith(tuple(tower))} == {torch.float32}
    assert {dtype for name, (dtype, _) in before.items() if not name.startswith(tuple(tower))} == {torch.bfloat16}

    vision = runner.info.vision
    pixels = image_processor(vision, tmp_path, None).pixels(random_image(3, (24, 24)))
    prompt, images = expand_images([5, 6, image_token, 7], vision, [pixels])
    blocks = list(range(-(-len(prompt) // runner.config.block_size)))
    step = SchedulerOutput(0, [ScheduledRequest("r", prompt, 0, blocks, True, True, len(prompt))], len(prompt), [], [])
    params = SamplingParams(temperature=0, max_tokens=1)
    result = runner.execute(ExecuteStep(step, [NewRequestData("r", params, prompt, [], images=images)]))
    assert len(result.sampled["r"]) == 1 and runner.encoder_cache.runs == 1  # the tower ran
    assert storage(model) == before
