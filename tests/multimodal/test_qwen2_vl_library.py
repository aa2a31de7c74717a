"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL MoE images through the library (`sonar.open`) on the real
engine (scheduler, worker, runner): prompts prefilled in chunks of 8 tokens (the step counter shows
it), so an image's rows, its M-RoPE positions and Qwen3-VL's DeepStack rows span several steps,
batched with another image request, with one tower run per image; greedy tokens equal
transformers'; a repeated image hits the prefix cache (the hit's first step gets the right 3D
positions, its last rows come from the encoder cache) and a different one does not."""

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


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-lib")
    return path, save_tiny_qwen2_5_vl(path, seed=5, family=request.param)


@pytest.fixture(scope="module")
async def llm(one_thread, tiny: tuple[Path, Any]):
    async with sonar.open(
        str(tiny[0]),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        max_num_seqs=2,  # an 8-token step budget needs max_num_seqs at most 8
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

    before = await llm.stats()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    after = await llm.stats()
    total = sum(len(ids) for ids, _ in prepared)
    assert after.num_steps - before.num_steps >= -(-total // 8)  # at most 8 tokens a step
    assert after.mm_encoder_runs - before.mm_encoder_runs == 3  # once per image, whatever the chunks
    for (ids, images), result in zip(prepared, results):
        assert result.outputs[0].token_ids == transformers_tokens(hf, ids, images, 6)


async def test_a_repeated_image_hits_the_prefix_cache(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    ids, images = await llm.add_images([3, *IMAGE, 4, 5, 6], [random_image(50, (48, 64))])
    # the hit's three blocks end inside the image: its first step embeds the image's last rows
    assert images[0].offset == 2 and images[0].length == 48 and len(ids) == 54
    before = await llm.stats()
    cold = await llm.generate(ids, GREEDY, images=images)
    middle = await llm.stats()
    warm = await llm.generate(ids, GREEDY, images=images)
    after = await llm.stats()
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 48
    # cold: 54 tokens in 7 steps of 8, one tower run; warm: the image's last rows from the encoder cache
    assert middle.num_steps - before.num_steps >= 7 and middle.mm_encoder_runs - before.mm_encoder_runs == 1
    assert (
        after.mm_encoder_runs - middle.mm_encoder_runs,
        after.mm_encoder_cache_hits - middle.mm_encoder_cache_hits,
    ) == (0, 1)
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
