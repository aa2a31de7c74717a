"""The largest image a request can bring, which the CUDA memory profile runs the vision tower on
(`sonar.multimodal.profile_image`, `ModelRunner.profile_image`): for each kind of tower, the
image is as large as the tokens allow and no larger, the tower takes it whole, and there is none
to profile with --skip-mm-profiling, without images, or where no image fits. (The profile itself
needs CUDA: tests_gpu/test_memory_gpu.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sonar.cli import parse_serve_args
from sonar.engine.config import EngineConfig
from sonar.engine.runner import ModelRunner
from tests.multimodal.tiny_gemma3 import TOKENS_PER_IMAGE, save_tiny_gemma3
from tests.multimodal.tiny_llava import save_tiny_llava
from tests.multimodal.tiny_llava_next import save_tiny_llava_next
from tests.multimodal.tiny_qwen2_vl import MAX_PIXELS, MERGE, PATCH, save_tiny_qwen2_5_vl

ENGINE: dict[str, Any] = dict(dtype="float32", num_gpu_blocks_override=16)


def runner(path: Path | None, **args: Any) -> ModelRunner:
    """A worker's model runner on CPU (None: the embedded model)."""
    return ModelRunner(EngineConfig.from_args(str(path) if path else None, **{**ENGINE, **args}))


def profiled_rows(r: ModelRunner) -> int:
    """The profile image's rows, checked against what the tower gives for it."""
    image = r.profile_image()
    assert image is not None
    features = r.encode_image(image)
    assert features.shape[0] == image.length
    return image.length


def test_a_dynamic_resolution_image_is_the_largest_square_the_model_length_or_max_pixels_allow(
    one_thread: None, tmp_path: Path
) -> None:
    save_tiny_qwen2_5_vl(tmp_path, seed=1)
    # 36 tokens: a 6 x 6 grid of merged patches (48 x 48 pixels)
    assert profiled_rows(runner(tmp_path, max_model_len=36)) == 36
    assert profiled_rows(runner(tmp_path, max_model_len=40)) == 36  # 7 x 7 would be 49
    # a longer model length: the processor's max_pixels (64 x 64) binds first
    assert profiled_rows(runner(tmp_path, max_model_len=256)) == MAX_PIXELS // (PATCH * MERGE) ** 2
    assert runner(tmp_path, max_model_len=256, skip_mm_profiling=True).profile_image() is None
    assert runner(tmp_path, max_model_len=256, limit_mm_per_prompt={"image": 0}).profile_image() is None


def test_an_any_resolution_image_takes_the_largest_tiling_that_fits(one_thread: None, tmp_path: Path) -> None:
    save_tiny_llava_next(tmp_path, seed=1)
    # the pinpoints (height x width) 16x32, 32x16, 32x32 in 16-pixel tiles of 4x4 patches: 16
    # base rows, then the map's lines with a newline each: 4 x 9, 8 x 5 and 8 x 9 more
    assert profiled_rows(runner(tmp_path, max_model_len=256)) == 88
    assert profiled_rows(runner(tmp_path, max_model_len=80)) == 56
    assert profiled_rows(runner(tmp_path, max_model_len=55)) == 52


def test_a_fixed_size_tower_takes_its_one_size(one_thread: None, tmp_path: Path) -> None:
    save_tiny_llava(tmp_path / "llava", seed=1)
    r = runner(tmp_path / "llava")
    assert profiled_rows(r) == r.info.vision.tokens_per_image
    assert runner(tmp_path / "llava", language_model_only=True).profile_image() is None


def test_an_image_computed_in_one_step_fits_the_step_budget(one_thread: None, tmp_path: Path) -> None:
    """Gemma 3 computes an image's tokens in one step: with a budget under its 16 rows every image
    request is refused, so there is no image to profile."""
    save_tiny_gemma3(tmp_path, seed=1)
    assert profiled_rows(runner(tmp_path, max_model_len=128)) == TOKENS_PER_IMAGE
    small = runner(tmp_path, max_model_len=128, max_num_batched_tokens=8, max_num_seqs=2)
    assert small.profile_image() is None


def test_a_text_only_model_has_no_image_to_profile(one_thread: None) -> None:
    assert runner(None, max_model_len=64).profile_image() is None


@pytest.mark.parametrize(("argv", "expected"), [([], False), (["--skip-mm-profiling"], True)])
def test_the_flag_reaches_the_engine(argv: list[str], expected: bool) -> None:
    assert parse_serve_args(argv).engine.skip_mm_profiling is expected
