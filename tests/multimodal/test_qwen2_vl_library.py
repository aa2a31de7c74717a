"""Qwen2.5-VL images through the library (`sonar.open`) on the real engine (scheduler, worker,
runner): prompts prefilled in chunks of 8 tokens, so an image's rows and its M-RoPE positions
span several steps, batched with another image request; greedy tokens equal transformers'; a
repeated image hits the prefix cache (the hit's first step gets the right 3D positions) and a
different one does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

import sonar
from sonar import InvalidRequestError, SamplingParams
from tests.multimodal.tiny_llava import random_image
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, VISION_END, VISION_START, save_tiny_qwen2_5_vl

pytestmark = pytest.mark.anyio

IMAGE = [VISION_START, IMAGE_PAD, VISION_END]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl-lib")
    return path, save_tiny_qwen2_5_vl(path, seed=5)


@pytest.fixture(scope="module")
async def llm(one_thread, tiny: tuple[Path, Any]):
    async with sonar.open(
        str(tiny[0]),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        block_size=16,
        limit_mm_per_prompt={"image": 2},
        seed=0,
    ) as engine:
        yield engine


def transformers_tokens(hf: Any, prompt: list[int], images: list[Any], n: int) -> list[int]:
    extra: dict[str, Any] = {}
    if images:
        extra = dict(
            pixel_values=torch.cat([im.pixel_values for im in images]),
            image_grid_thw=torch.tensor([im.grid for im in images]),
            mm_token_type_ids=torch.tensor([[int(t == IMAGE_PAD) for t in prompt]]),
        )
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            **extra,
        )
    return out[0, len(prompt) :].tolist()


async def test_chunked_batched_image_prompts_equal_transformers(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    _, hf = tiny
    prompts = [[3, *IMAGE, 4, 5], [6, 7, *IMAGE, 8, *IMAGE, 9], [10, 11, 12]]
    pictures = [[random_image(40, (40, 24))], [random_image(41, (24, 40)), random_image(42, (32, 32))], []]
    prepared = [await llm.add_images(p, pics) if pics else (p, []) for p, pics in zip(prompts, pictures)]
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        ids, images = prepared[i]
        results[i] = await llm.generate(ids, GREEDY, images=images)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    for (ids, images), result in zip(prepared, results):
        assert result.outputs[0].token_ids == transformers_tokens(hf, ids, images, 6)


async def test_a_repeated_image_hits_the_prefix_cache(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    ids, images = await llm.add_images([3, *IMAGE, 4, 5, 6], [random_image(50, (48, 64))])
    # the hit's three blocks end inside the image: its first step embeds the image's last rows
    assert images[0].offset == 2 and images[0].length == 48 and len(ids) == 54
    cold = await llm.generate(ids, GREEDY, images=images)
    warm = await llm.generate(ids, GREEDY, images=images)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 48
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == transformers_tokens(tiny[1], ids, images, 6)
    _, other = await llm.add_images([3, *IMAGE, 4, 5, 6], [random_image(51, (48, 64))])
    assert (await llm.generate(ids, GREEDY, images=other)).num_cached_tokens == 0


async def test_a_grid_that_does_not_fit_is_refused(llm: sonar.LLM) -> None:
    ids, images = await llm.add_images([3, *IMAGE, 4], [random_image(60, (24, 16))])
    cases = {
        "does not fit": [msgspec.structs.replace(images[0], grid=[1, 4, 4])],
        "needs a grid": [msgspec.structs.replace(images[0], grid=None)],
        "videos are not served": [msgspec.structs.replace(images[0], grid=[2, 2, 6])],
        "pixels of shape": [msgspec.structs.replace(images[0], pixel_values=torch.zeros(3, 8, 8))],
    }
    for expected, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=expected):
            await llm.generate(ids, GREEDY, images=bad)
    assert len((await llm.generate(ids, GREEDY, images=images)).outputs[0].token_ids) == 6
