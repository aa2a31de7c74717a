"""LLaVA-NeXT against transformers: the same tiny random checkpoint, the same tiles, the same
prompt (expanded as transformers' `LlavaNextProcessor` expands it, constructed here); the token
count of pictures of many shapes equals the processor's, and for a wide and a tall picture every
prompt position's logits and the greedy tokens after it equal transformers', prefilled whole and
in chunks that cut through the images' tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sonar.core.anyres import feature_rows
from sonar.models.errors import ModelLoadError
from sonar.models.llava_next import LlavaNextForConditionalGeneration
from sonar.models.loader import load_model
from sonar.multimodal.limits import ProcessorConfigError
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import ImageInput
from tests.models.against import ATOL, RTOL
from tests.models.test_llava import sonar_greedy
from tests.multimodal.tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_ID, PATCH, random_image
from tests.multimodal.tiny_llava_next import (
    PINPOINTS,
    TALL,
    WIDE,
    batched_tiles,
    llava_next_config,
    save_tiny_llava_next,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    path = tmp_path_factory.mktemp("llava-next")
    hf = save_tiny_llava_next(path, seed=3)
    return path, hf, load_model(str(path), dtype="float32").model


def _prompt(path: Path, model: Any, images: list[Any]) -> tuple[list[int], list[ImageInput]]:
    processor = image_processor(model.vision_info(), path, None)
    ids = [5, 6, IMAGE_TOKEN_ID, 7, 8, 9]
    if len(images) > 1:
        ids += [10, IMAGE_TOKEN_ID, 11]
    return expand_images(ids, model.vision_info(), [processor.pixels(im) for im in images])


@pytest.mark.parametrize("size", [WIDE, TALL, (33, 17), (16, 16), (23, 50), (64, 9), (31, 33)])
def test_expansion_matches_llava_next_processor(tiny: tuple[Path, Any, Any], size: tuple[int, int]) -> None:
    from transformers import AutoTokenizer, LlavaNextImageProcessorPil, LlavaNextProcessor

    path, _, model = tiny
    tok = AutoTokenizer.from_pretrained(str(path))
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil.from_pretrained(str(path)),
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    image = random_image(1, size)
    ref = processor(text="w5 <image> w7", images=[image], return_tensors="pt")
    pixels = image_processor(model.vision_info(), path, None).pixels(image)
    ids, images = expand_images(tok("w5 <image> w7").input_ids, model.vision_info(), [pixels])
    assert ids == ref["input_ids"][0].tolist()
    assert images[0].length == feature_rows((size[1], size[0]), PINPOINTS, IMAGE_SIZE, PATCH)
    assert images[0].grid == ref["image_sizes"][0].tolist()
    torch.testing.assert_close(images[0].pixel_values, ref["pixel_values"][0])


@pytest.mark.parametrize("sizes", [[WIDE], [TALL], [TALL, WIDE]], ids=["wide", "tall", "both"])
def test_logits_and_greedy_tokens_equal_transformers(tiny: tuple[Path, Any, Any], sizes: list[Any]) -> None:
    path, hf, model = tiny
    prompt, images = _prompt(path, model, [random_image(i, size) for i, size in enumerate(sizes)])
    inputs = batched_tiles(images)
    with torch.inference_mode():
        full = hf(input_ids=torch.tensor([prompt]), **inputs).logits[0]
        ref = hf.generate(
            torch.tensor([prompt]),
            **inputs,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=4,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens, ref_logits = ref.sequences[0, len(prompt) :].tolist(), torch.cat(ref.logits).float()
    for chunk in (len(prompt), 7):  # whole, and in chunks that cut through the images' tokens
        prompt_logits, (tokens, logits) = sonar_greedy(model, prompt, images, chunk, 4)
        torch.testing.assert_close(prompt_logits, full.float(), atol=ATOL, rtol=RTOL)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


def test_features_equal_transformers_image_features(tiny: tuple[Path, Any, Any]) -> None:
    path, hf, model = tiny
    _, images = _prompt(path, model, [random_image(4, TALL)])
    with torch.inference_mode():
        ref = hf.get_image_features(
            pixel_values=images[0].pixel_values.unsqueeze(0), image_sizes=torch.tensor([images[0].grid])
        ).pooler_output[0]
        ours = model.encode_grid(images[0].pixel_values, images[0].grid)
    assert ours.shape[0] == images[0].length
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_unsupported_configs_are_refused(tmp_path: Path) -> None:
    config = llava_next_config()
    config.vision_feature_select_strategy = "full"
    with pytest.raises(ModelLoadError, match="vision_feature_select_strategy 'full'"):
        LlavaNextForConditionalGeneration(config)
    config = llava_next_config()
    config.image_grid_pinpoints = [[16, 24]]
    with pytest.raises(ModelLoadError, match="multiples of the 16-pixel tile"):
        LlavaNextForConditionalGeneration(config)


def test_processor_settings_must_keep_the_models_tiles(tiny: tuple[Path, Any, Any]) -> None:
    path, _, model = tiny
    with pytest.raises(ProcessorConfigError, match="tiles of the vision tower's 16x16"):
        image_processor(model.vision_info(), path, {"crop_size": {"height": 8, "width": 8}})
    with pytest.raises(ProcessorConfigError, match="min_pixels"):
        image_processor(model.vision_info(), path, {"min_pixels": 100})
    assert image_processor(model.vision_info(), None, None).processor.image_grid_pinpoints == PINPOINTS
