"""LLaVA-NeXT through the library (`sonar.open`) on the real engine (scheduler, worker, runner),
each prompt prefilled whole: a wide and a tall picture, batched, give transformers' greedy tokens
with their logprobs within 1e-4; tiles that do not match their image's size are refused where the
request enters the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

import sonar
from sonar import InvalidRequestError, SamplingParams
from tests.multimodal.tiny_llava import IMAGE_TOKEN_ID, random_image
from tests.multimodal.tiny_llava_next import TALL, WIDE, batched_tiles, save_tiny_llava_next

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-llava-next-lib")
    return path, save_tiny_llava_next(path, seed=4)


@pytest.fixture(scope="module")
async def llm(one_thread, tiny: tuple[Path, Any]):
    async with sonar.open(
        str(tiny[0]), dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0
    ) as engine:
        yield engine


def transformers_greedy(hf: Any, prompt: list[int], images: list[Any], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs."""
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            **batched_tiles(images),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(torch.log_softmax(row[0].float(), -1)[t]) for row, t in zip(out.logits, tokens)]
    return tokens, logprobs


async def test_wide_and_tall_pictures_batched_equal_transformers(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    _, hf = tiny
    prompts = [[3, IMAGE_TOKEN_ID, 4, 5], [6, 7, IMAGE_TOKEN_ID, 8, IMAGE_TOKEN_ID, 9]]
    pictures = [[random_image(40, WIDE)], [random_image(41, TALL), random_image(42, WIDE)]]
    prepared = [await llm.add_images(p, pics) for p, pics in zip(prompts, pictures)]
    assert [im.length for im in prepared[1][1]] == [56, 52]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=0)
    results: list[Any] = [None, None]

    async def one(i: int) -> None:
        ids, images = prepared[i]
        results[i] = await llm.generate(ids, params, images=images)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(one, i)
    for (ids, images), result in zip(prepared, results):
        tokens, logprobs = transformers_greedy(hf, ids, images, 5)
        assert result.outputs[0].token_ids == tokens
        assert [p.logprob for p in result.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)


async def test_tiles_that_do_not_fit_the_size_are_refused(llm: sonar.LLM) -> None:
    ids, images = await llm.add_images([3, IMAGE_TOKEN_ID, 4], [random_image(60, WIDE)])
    image = images[0]
    for bad, expected in [
        (msgspec.structs.replace(image, pixel_values=image.pixel_values[:2]), "pixels of shape"),
        (msgspec.structs.replace(image, grid=list(reversed(image.grid))), "does not fit"),
        (msgspec.structs.replace(image, grid=[0, 5]), r"needs its \(height, width\)"),
        (msgspec.structs.replace(image, grid=None), r"needs its \(height, width\)"),
    ]:
        with pytest.raises(InvalidRequestError, match=expected):
            await llm.generate(ids, SamplingParams(max_tokens=1), images=[bad])
