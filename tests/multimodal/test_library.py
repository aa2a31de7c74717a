"""Images through the library (`sonar.open`): `add_images` then `generate`, on the real engine
(scheduler, worker, runner) with a tiny LLaVA; prompts prefilled in chunks of 8 tokens, so each
image's 16 rows span several steps, batched with another image's request; a request whose
images do not sit on its image tokens is refused where it enters the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

import sonar
from sonar import InvalidRequestError, SamplingParams
from tests.multimodal.tiny_llava import IMAGE_TOKEN_ID, random_image, save_tiny_llava

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-llava-lib")
    return path, save_tiny_llava(path, seed=3)


@pytest.fixture(scope="module")
async def llm(one_thread, tiny: tuple[Path, Any]):
    async with sonar.open(
        str(tiny[0]),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,
        max_num_seqs=2,  # an 8-token step budget needs max_num_seqs at most 8
        limit_mm_per_prompt={"image": 2},
        seed=0,
    ) as engine:
        yield engine


def transformers_tokens(hf: Any, prompt: list[int], pixels: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            pixel_values=pixels,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(temperature=0, max_tokens=5)


async def test_chunked_batched_image_prompts_equal_transformers(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    _, hf = tiny
    prompts = [[3, IMAGE_TOKEN_ID, 4, 5], [6, 7, IMAGE_TOKEN_ID, 8, IMAGE_TOKEN_ID, 9]]
    pictures = [[random_image(40)], [random_image(41), random_image(42)]]
    prepared = [await llm.add_images(p, pics) for p, pics in zip(prompts, pictures)]
    results: list[Any] = [None, None]

    async def one(i: int) -> None:
        ids, images = prepared[i]
        results[i] = await llm.generate(ids, GREEDY, images=images)

    before = await llm.stats()
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(one, i)
    after = await llm.stats()
    # 54 prompt tokens at most 8 a step: at least 7 prefill steps, one tower run per image
    assert after.num_steps - before.num_steps >= 7 + 4
    assert after.mm_encoder_runs - before.mm_encoder_runs == 3
    for (ids, images), result in zip(prepared, results):
        pixels = torch.stack([im.pixel_values for im in images])
        assert result.outputs[0].token_ids == transformers_tokens(hf, ids, pixels, 5)


async def test_the_tower_runs_once_per_image(llm: sonar.LLM, tiny: tuple[Path, Any]) -> None:
    """A 20-token prompt takes three steps, the image's 16 rows cut by two of them: the tower runs
    once; the same picture after other tokens (no prefix hit) takes its rows from the encoder cache."""
    picture = random_image(70)
    ids, images = await llm.add_images([3, IMAGE_TOKEN_ID, 4, 5, 6], [picture])
    before = await llm.stats()
    first = await llm.generate(ids, SamplingParams(temperature=0, max_tokens=1), images=images)
    after = await llm.stats()
    assert after.num_steps - before.num_steps == 3
    assert (
        after.mm_encoder_runs - before.mm_encoder_runs,
        after.mm_encoder_cache_hits - before.mm_encoder_cache_hits,
    ) == (1, 0)
    pixels = images[0].pixel_values.unsqueeze(0)
    assert first.outputs[0].token_ids == transformers_tokens(tiny[1], ids, pixels, 1)
    again, images = await llm.add_images([9, 8, IMAGE_TOKEN_ID, 4], [picture])
    second = await llm.generate(again, GREEDY, images=images)
    last = await llm.stats()
    assert second.num_cached_tokens == 0
    assert (last.mm_encoder_runs - after.mm_encoder_runs, last.mm_encoder_cache_hits - after.mm_encoder_cache_hits) == (
        0,
        1,
    )
    assert second.outputs[0].token_ids == transformers_tokens(tiny[1], again, pixels, 5)


async def test_a_repeated_image_hits_the_prefix_cache(llm: sonar.LLM) -> None:
    ids, images = await llm.add_images([3, IMAGE_TOKEN_ID, 4, 5, 6], [random_image(50)])
    cold = await llm.generate(ids, GREEDY, images=images)
    warm = await llm.generate(ids, GREEDY, images=images)
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 16
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    _, other = await llm.add_images([3, IMAGE_TOKEN_ID, 4, 5, 6], [random_image(51)])
    assert (await llm.generate(ids, GREEDY, images=other)).num_cached_tokens == 0


async def test_misplaced_images_are_refused(llm: sonar.LLM) -> None:
    ids, images = await llm.add_images([3, IMAGE_TOKEN_ID, 4], [random_image(60)])
    cases = {
        "does not fit": [msgspec.structs.replace(images[0], length=15)],
        "not placed on image tokens": [msgspec.structs.replace(images[0], offset=0)],
        "without their image": [],
        "pixels of shape": [msgspec.structs.replace(images[0], pixel_values=torch.zeros(3, 8, 8))],
    }
    for expected, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=expected):
            await llm.generate(ids, GREEDY, images=bad)
    with pytest.raises(InvalidRequestError, match="at most 2 image"):
        await llm.add_images([IMAGE_TOKEN_ID] * 3, [random_image(i) for i in range(3)])
    # the engine still serves after the refusals
    assert len((await llm.generate(ids, GREEDY, images=images)).outputs[0].token_ids) == 5


async def test_images_past_the_context_are_refused_before_loading(llm: sonar.LLM) -> None:
    """100 text tokens and two images' 32 rows pass max_model_len 128: refused from the count."""
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.check_images([3] * 100 + [IMAGE_TOKEN_ID] * 2, 2)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        await llm.add_images([3] * 100 + [IMAGE_TOKEN_ID] * 2, [random_image(1), random_image(2)])


async def test_a_picture_sent_again_comes_from_the_processed_cache(llm: sonar.LLM) -> None:
    """`prepare_image` (what the chat route calls with an image's bytes): the second time the
    same bytes are neither decoded nor preprocessed, and the answer is the picture's."""
    import io

    from sonar.multimodal.media import MediaPolicy, decode_image
    from sonar.multimodal.processor import Processed

    buf = io.BytesIO()
    picture = random_image(70)
    picture.save(buf, format="PNG")
    data, decoded = buf.getvalue(), []

    def decode(raw: bytes) -> Any:
        decoded.append(raw)
        return decode_image(raw, MediaPolicy(), "image")

    hits = llm.processed_images.stats.hits
    first = await llm.prepare_image(data, decode)
    again = await llm.prepare_image(data, decode)
    assert isinstance(again, Processed) and again.value is first.value
    assert len(decoded) == 1 and llm.processed_images.stats.hits == hits + 1
    ids, images = await llm.add_images([3, IMAGE_TOKEN_ID, 4], [again])
    by_picture = await llm.add_images([3, IMAGE_TOKEN_ID, 4], [picture])
    assert images[0].hash == by_picture[1][0].hash
    assert (await llm.generate(ids, GREEDY, images=images)).outputs[0].token_ids == (
        (await llm.generate(*by_picture[:1], GREEDY, images=by_picture[1])).outputs[0].token_ids
    )
