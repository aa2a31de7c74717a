"""The dynamic-resolution processor: ``--mm-processor-kwargs`` min_pixels / max_pixels bound an
image's area (so its tokens), settings it has no use for are refused, and the CLIP processor
refuses the dynamic-only ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar.models.qwen2_vl import IMAGE_TEXT
from sonar.multimodal.limits import ProcessorConfigError
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import VisionInfo
from tests.multimodal.tiny_llava import random_image
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, MAX_PIXELS, MERGE, PATCH, TEMPORAL, save_tiny_qwen2_5_vl

VISION = VisionInfo(IMAGE_PAD, 0, 0, IMAGE_TEXT, PATCH, MERGE, TEMPORAL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen-processor")
    save_tiny_qwen2_5_vl(path)
    return path


def test_max_and_min_pixels_bound_the_grid(folder: Path) -> None:
    big = random_image(0, (200, 120))
    _, grid = image_processor(VISION, folder, None).pixels(big)
    assert grid[0] == 1 and grid[1] * grid[2] * PATCH**2 <= MAX_PIXELS
    pixels, small = image_processor(VISION, folder, {"max_pixels": 32 * 32}).pixels(big)
    assert small[1] * small[2] * PATCH**2 <= 32 * 32 < grid[1] * grid[2] * PATCH**2
    assert tuple(pixels.shape) == (small[1] * small[2], 3 * TEMPORAL * PATCH**2)
    _, tiny = image_processor(VISION, None, {"min_pixels": 48 * 48}).pixels(random_image(1, (8, 8)))
    assert tiny[1] * tiny[2] * PATCH**2 >= 48 * 48
    ids, images = expand_images([3, IMAGE_PAD, 4], VISION, [(pixels, small)])
    assert images[0].length == small[1] * small[2] // MERGE**2 == len(ids) - 2


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"crop_size": {"height": 8, "width": 8}}, "does not crop"),
        ({"max_pixels": -1}, "positive number of pixels"),
        ({"min_pixels": 4096, "max_pixels": 1024}, "above max_pixels"),
        ({"patch_size": 8}, "not supported"),
    ],
)
def test_settings_it_cannot_apply_are_refused(folder: Path, kwargs: dict, expected: str) -> None:
    with pytest.raises(ProcessorConfigError, match=expected):
        image_processor(VISION, folder, kwargs)


def test_the_clip_processor_refuses_pixel_bounds() -> None:
    with pytest.raises(ProcessorConfigError, match="dynamic-resolution"):
        image_processor(VisionInfo(5, 16, 16), None, {"max_pixels": 1024})
