"""Gemma 3's image preprocessing (`sonar.multimodal.gemma3`) and placeholder text against
transformers': the same pixels as `Gemma3ImageProcessorPil` from the checkpoint's config, the
prompt transformers' `Gemma3Processor` makes of ``<start_of_image>``; pan-and-scan, crops and a
size other than the tower's refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar.models.gemma3_vl import IMAGE_TEXT
from sonar.multimodal.gemma3 import Gemma3ImageProcessor
from sonar.multimodal.limits import ProcessorConfigError
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import VisionInfo
from tests.multimodal.tiny_gemma3 import IMAGE_SIZE, IMAGE_TOKEN, TOKENS_PER_IMAGE, save_tiny_gemma3
from tests.multimodal.tiny_llava import random_image

VISION = VisionInfo(IMAGE_TOKEN, TOKENS_PER_IMAGE, IMAGE_SIZE, IMAGE_TEXT, processor="gemma3", bidirectional=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-processor")
    save_tiny_gemma3(path)
    return path


def test_the_model_picks_this_processor(path: Path) -> None:
    assert isinstance(image_processor(VISION, path, None), Gemma3ImageProcessor)


def test_expansion_and_pixels_match_gemma3_processor(path: Path) -> None:
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(path))
    image = random_image(1, (40, 24))
    ref = Gemma3ImageProcessorPil.from_pretrained(str(path))(images=[image], return_tensors="pt")
    # what Gemma3Processor puts where the chat template wrote <start_of_image>
    full = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS_PER_IMAGE + "<end_of_image>\n\n"
    text = "w5 {} w7"
    vision = VISION
    ids, images = expand_images(
        tok(text.format(vision.image_text)).input_ids, vision, [Gemma3ImageProcessor(vision, path, None).pixels(image)]
    )
    assert ids == tok(text.format(full)).input_ids
    assert images[0].offset == 2 and images[0].length == TOKENS_PER_IMAGE
    torch.testing.assert_close(images[0].pixel_values, ref["pixel_values"][0])


def test_pan_and_scan_and_crops_are_refused(path: Path) -> None:
    vision = VISION
    with pytest.raises(ProcessorConfigError, match="do_pan_and_scan"):
        Gemma3ImageProcessor(vision, None, {"do_pan_and_scan": True})
    with pytest.raises(ProcessorConfigError, match="crop_size"):
        Gemma3ImageProcessor(vision, path, {"crop_size": {"height": 32, "width": 32}})
    with pytest.raises(ProcessorConfigError, match="32x32"):
        Gemma3ImageProcessor(vision, path, {"size": {"height": 16, "width": 16}})
