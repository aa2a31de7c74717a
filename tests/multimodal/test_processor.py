"""`sonar.multimodal.processor` and `limits`: pixels as transformers' CLIP processor makes them,
placeholders expanded in place, content hashes, and the limits and overrides refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar.errors import InvalidRequestError
from sonar.multimodal.limits import DEFAULT_LIMIT, ProcessorConfigError, image_limit
from sonar.multimodal.processor import ImageProcessor, expand_images, image_hash
from sonar.protocol.engine import VisionInfo
from tests.multimodal.tiny_llava import random_image

VISION = VisionInfo(image_token_id=9, tokens_per_image=3, image_size=16)


def test_pixels_equal_clip_image_processor(tmp_path: Path) -> None:
    from transformers import CLIPImageProcessorPil

    reference = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    reference.save_pretrained(str(tmp_path))
    image = random_image(4, (30, 21))
    expected = reference(images=[image], return_tensors="pt")["pixel_values"][0]
    for folder in (tmp_path, None):  # the saved config, and the defaults from the tower's size
        pixels = ImageProcessor(VISION, folder, None).pixels(image)
        assert pixels.shape == (3, 16, 16) and pixels.dtype == torch.float32
        torch.testing.assert_close(pixels, expected)


def test_overrides_apply_and_are_checked() -> None:
    image = random_image(5)
    plain = ImageProcessor(VISION, None, None).pixels(image)
    raw = ImageProcessor(VISION, None, {"do_normalize": False}).pixels(image)
    assert raw.min() >= 0 and raw.max() <= 1 and not torch.allclose(plain, raw)
    with pytest.raises(ProcessorConfigError, match="num_crops not supported"):
        ImageProcessor(VISION, None, {"num_crops": 4})
    with pytest.raises(ProcessorConfigError, match="16x16 input"):
        ImageProcessor(VISION, None, {"crop_size": {"height": 8, "width": 8}})


def test_expansion_places_each_image_on_its_tokens() -> None:
    a, b = torch.zeros(3, 16, 16), torch.ones(3, 16, 16)
    ids, images = expand_images([1, 9, 2, 9], VISION, [a, b])
    assert ids == [1, 9, 9, 9, 2, 9, 9, 9]
    assert [(im.offset, im.length) for im in images] == [(1, 3), (5, 3)]
    assert images[0].hash == image_hash(a) != images[1].hash == image_hash(b)
    assert image_hash(a.clone()) == images[0].hash  # by content
    with pytest.raises(InvalidRequestError, match="2 image placeholder"):
        expand_images([9, 9], VISION, [a])


def test_limits() -> None:
    assert image_limit({}) == DEFAULT_LIMIT == 999
    assert image_limit({"image": 2}) == 2
    assert image_limit({"image": {"count": 1}, "video": 0}) == 1
    assert image_limit({"image": 4}, language_model_only=True) == 0
    for bad, message in [
        ({"smell": 1}, "unknown modality 'smell'"),
        ({"image": -1}, "count >= 0"),
        ({"image": "2"}, "count >= 0"),
        ({"image": {"count": 1, "width": 512}}, "['width'] are not supported"),
    ]:
        with pytest.raises(ProcessorConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            image_limit(bad)


def test_flags_reach_the_engine_config_and_bad_ones_fail_at_startup() -> None:
    from sonar.cli.parse import parse_serve_args
    from sonar.engine.config import EngineConfig

    config = parse_serve_args(
        ["m", "--limit-mm-per-prompt", '{"image": 3}', "--mm-processor-kwargs", '{"do_normalize": false}']
    )
    assert config.engine.limit_mm_per_prompt == {"image": 3}
    assert config.engine.mm_processor_kwargs == {"do_normalize": False}
    assert parse_serve_args(["m", "--language-model-only"]).engine.language_model_only
    media = parse_serve_args(["m", "--allowed-local-media-path", "/srv", "--allowed-media-domains", "a.org", "b.org"])
    assert (media.allowed_local_media_path, media.allowed_media_domains) == ("/srv", ("a.org", "b.org"))
    with pytest.raises(ValueError, match="num_crops not supported"):
        EngineConfig.from_args("m", mm_processor_kwargs={"num_crops": 4})
    with pytest.raises(ValueError, match="unknown modality"):
        EngineConfig.from_args("m", limit_mm_per_prompt={"smell": 1})
