"""Gemma 3 with images through the library (`sonar.open`) on the real engine (scheduler, worker,
runner): image prompts batched with a text-only one, prefilled in steps of at most 17 tokens
(ended before an image, never inside one), give transformers' greedy tokens; an image given as
transformers' own image features (--enable-mm-embeds) gives the picture's tokens, and a repeat
hits the prefix cache; an image longer than a step's token budget is refused, not cut, and so are
images with no token between them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar import InvalidRequestError, SamplingParams
from tests.multimodal.tiny_gemma3 import BOI, EOI, IMAGE_TOKEN, TOKENS_PER_IMAGE, save_tiny_gemma3
from tests.multimodal.tiny_llava import random_image

pytestmark = pytest.mark.anyio

IMAGE = [BOI, IMAGE_TOKEN, EOI]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=16, max_num_seqs=4, seed=0)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-gemma3-lib")
    return path, save_tiny_gemma3(path, seed=5)


@pytest.fixture(scope="module")
async def llm(one_thread, tiny: tuple[Path, Any]):
    async with sonar.open(
        str(tiny[0]), max_num_batched_tokens=17, limit_mm_per_prompt={"image": 2}, enable_mm_embeds=True, **ENGINE
    ) as engine:
        yield engine


def transformers_tokens(hf: Any, prompt: list[int], pixels: list[Any], n: int) -> list[int]:
    extra: dict[str, Any] = {}
    if pixels:
        extra = dict(
            pixel_values=torch.stack(pixels), token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN) for t in prompt]])
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


async def test_batched_image_prompts_equal_transformers(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
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
    assert after.num_steps - before.num_steps >= -(-total // 17)  # at most 17 tokens a step
    assert after.mm_encoder_runs - before.mm_encoder_runs == 3  # one tower run per image
    for (ids, images), result in zip(prepared, results):
        expected = transformers_tokens(hf, ids, [im.pixel_values for im in images], 6)
        assert result.outputs[0].token_ids == expected


async def test_image_features_give_the_pictures_tokens(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    _, hf = tiny
    prompt = [3, *IMAGE, 4, 5]
    ids, images = await llm.add_images(prompt, [random_image(30)])
    by_picture = await llm.generate(ids, GREEDY, images=images)
    with torch.inference_mode():
        features = hf.model.get_image_features(pixel_values=images[0].pixel_values[None]).pooler_output[0]
    given_ids, given = await llm.add_images(prompt, [features])
    assert given_ids == ids and given[0].embeds and given[0].length == TOKENS_PER_IMAGE
    by_rows = await llm.generate(given_ids, GREEDY, images=given)
    assert by_rows.outputs[0].token_ids == by_picture.outputs[0].token_ids
    assert by_picture.outputs[0].token_ids == transformers_tokens(hf, ids, [images[0].pixel_values], 6)
    again = await llm.generate(given_ids, GREEDY, images=given)  # block 0 ends inside the image
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == by_rows.outputs[0].token_ids


async def test_an_image_longer_than_a_step_is_refused(one_thread, tiny: tuple[Path, Any]) -> None:
    async with sonar.open(str(tiny[0]), max_num_batched_tokens=8, **ENGINE) as small:
        ids, images = await small.add_images([3, *IMAGE, 4], [random_image(31)])
        with pytest.raises(InvalidRequestError, match="are 16, more than one step's 8"):
            await small.generate(ids, GREEDY, images=images)
        assert len((await small.generate([3, 4, 5], GREEDY)).outputs[0].token_ids) == 6


async def test_images_with_no_token_between_are_refused(llm: sonar.LLM) -> None:
    ids, images = await llm.add_images([3, IMAGE_TOKEN, IMAGE_TOKEN, 4], [random_image(32), random_image(33)])
    with pytest.raises(InvalidRequestError, match="no token between them"):
        await llm.generate(ids, GREEDY, images=images)
