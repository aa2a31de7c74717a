"""Images given as their feature rows (--enable-mm-embeds, `sonar.engine.image_embeds`) through
the library on the real engine: transformers' own image features for a picture give the same
greedy tokens as the picture (a tiny LLaVA, and a tiny Qwen2.5-VL whose rows come with their
grid and M-RoPE positions), prefilled in chunks that cut through the rows; with an image limit of
0 the embeddings still pass while a picture is refused; and every malformed form is a 400
naming it (the HTTP forms are read without running pickled code)."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import sonar
from sonar import InvalidRequestError, SamplingParams
from sonar.engine.image_embeds import part_embeds
from sonar.multimodal.processor import ImageEmbeds
from tests.multimodal.tiny_llava import IMAGE_TOKEN_ID, random_image, save_tiny_llava
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, VISION_END, VISION_START, save_tiny_qwen2_5_vl

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0, max_tokens=6)
# an 8-token step budget needs max_num_seqs at most 8
ENGINE = dict(
    dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=8, max_num_seqs=2, seed=0, enable_mm_embeds=True
)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def saved(obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


class Payload:
    """What a hostile pickle would run on load: it must never be called."""

    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-llava-embeds")
    return path, save_tiny_llava(path, seed=4)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}-embeds")
    return path, save_tiny_qwen2_5_vl(path, seed=6, family=request.param)


async def test_llava_features_give_the_pictures_tokens_and_skip_a_zero_limit(
    one_thread: None, llava: tuple[Path, Any]
) -> None:
    path, hf = llava
    prompt = [3, IMAGE_TOKEN_ID, 4, 5]
    async with sonar.open(str(path), max_model_len=128, limit_mm_per_prompt={"image": 2}, **ENGINE) as llm:
        ids, images = await llm.add_images(prompt, [random_image(30)])
        by_picture = await llm.generate(ids, GREEDY, images=images)
        with torch.inference_mode():
            features = hf.model.get_image_features(pixel_values=images[0].pixel_values[None]).pooler_output[0]
        given_ids, given = await llm.add_images(prompt, [features])
        assert given_ids == ids and given[0].embeds and given[0].length == 16
        by_rows = await llm.generate(given_ids, GREEDY, images=given)
        assert by_rows.outputs[0].token_ids == by_picture.outputs[0].token_ids
        # a repeat hits the prefix cache by the rows' hash, which is not the picture's
        assert (await llm.generate(given_ids, GREEDY, images=given)).num_cached_tokens == 16
        assert given[0].hash != images[0].hash

        hidden = features.shape[1]
        for bad, says in [
            (torch.zeros(15, hidden), "has 15 rows, the model's image placeholder takes 16"),
            (torch.zeros(16, hidden + 1), r"\[tokens, 64\]"),
            (torch.full((16, hidden), float("nan")), "finite"),
            (torch.zeros(16, hidden, dtype=torch.int64), "floating-point"),
            ({"image_embeds": features, "pixels": 1}, "not \\['pixels'\\]"),
        ]:
            with pytest.raises(InvalidRequestError, match=says):
                await llm.add_images(prompt, [bad])

        with_tower = llm.info.weights_bytes
    # transformers' tower and projector, less CLIP's post-LayerNorm, which Sonar never loads (never read)
    unread = hf.model.vision_tower.post_layernorm
    parts = (hf.model.vision_tower, hf.model.multi_modal_projector)
    tower = sum(p.nbytes for m in parts for p in m.parameters()) - sum(p.nbytes for p in unread.parameters())
    async with sonar.open(str(path), max_model_len=128, limit_mm_per_prompt={"image": 0}, **ENGINE) as llm:
        assert llm.info.weights_bytes == with_tower - tower  # the worker holds no tower
        given_ids, given = await llm.add_images(prompt, [features])
        assert (await llm.generate(given_ids, GREEDY, images=given)).outputs[0].token_ids == (
            by_picture.outputs[0].token_ids
        )
        with pytest.raises(InvalidRequestError, match="at most 0 image"):
            await llm.add_images(prompt, [random_image(30)])
        # this worker has no tower (`sonar.models.loader.drop_tower`): pictures made elsewhere are refused too
        with pytest.raises(InvalidRequestError, match="at most 0 image"):
            await llm.generate(ids, GREEDY, images=images)
        assert (await llm.generate(given_ids, GREEDY, images=given)).outputs[0].token_ids == (
            by_picture.outputs[0].token_ids
        )


async def test_qwen_rows_with_their_grid_give_the_pictures_tokens(one_thread: None, qwen: tuple[Path, Any]) -> None:
    """The grid places the rows' M-RoPE positions: without it the rows are refused. Qwen3-VL's rows
    carry their DeepStack sets beside them (``[rows, hidden * (1 + sets)]``); rows without them
    are refused, never served without DeepStack."""
    path, hf = qwen
    prompt = [3, VISION_START, IMAGE_PAD, VISION_END, 4, 5]
    async with sonar.open(str(path), max_model_len=256, block_size=16, **ENGINE) as llm:
        ids, images = await llm.add_images(prompt, [random_image(31, (40, 24))])
        by_picture = await llm.generate(ids, GREEDY, images=images)
        grid = images[0].grid
        with torch.inference_mode():
            out = hf.model.get_image_features(pixel_values=images[0].pixel_values, image_grid_thw=torch.tensor([grid]))
        deep = [sets[0] for sets in getattr(out, "deepstack_features", None) or []]
        features = torch.cat([out.pooler_output[0], *deep], dim=-1)
        if deep:
            with pytest.raises(InvalidRequestError, match="must have the shape"):
                await llm.add_images(prompt, [{"image_embeds": out.pooler_output[0], "image_grid_thw": grid}])
        given_ids, given = await llm.add_images(prompt, [{"image_embeds": features, "image_grid_thw": grid}])
        assert given_ids == ids and given[0].grid == grid
        by_rows = await llm.generate(given_ids, GREEDY, images=given)
        assert by_rows.outputs[0].token_ids == by_picture.outputs[0].token_ids
        # the HTTP form reads to the same thing
        read = llm.read_image_embeds(
            {"image_embeds": saved(features), "image_grid_thw": saved(torch.tensor([grid]))}, "messages[0].content[0]"
        )
        assert torch.equal(read.rows, features) and list(read.grid) == grid
        for bad, says in [
            (features, "need their image_grid_thw"),
            ({"image_embeds": features, "image_grid_thw": [1, 5, 6]}, "multiples of 2"),
            ({"image_embeds": features, "image_grid_thw": [1.0, 4.0, 6.0]}, "three integers"),
            ({"image_embeds": features, "image_grid_thw": [1, 4, 4096]}, "between 1 and 1024"),
        ]:
            with pytest.raises(InvalidRequestError, match=says):
                await llm.add_images(prompt, [bad])


async def test_without_the_flag_embeddings_are_refused(one_thread: None, llava: tuple[Path, Any]) -> None:
    path, _ = llava
    engine = {**ENGINE, "enable_mm_embeds": False}
    async with sonar.open(str(path), max_model_len=128, **engine) as llm:
        with pytest.raises(InvalidRequestError, match="--enable-mm-embeds"):
            await llm.add_images([3, IMAGE_TOKEN_ID], [torch.zeros(16, 64)])
        with pytest.raises(InvalidRequestError, match="--enable-mm-embeds"):
            llm.read_image_embeds(saved(torch.zeros(16, 64)), "messages[0].content[0]")


def test_the_http_forms_are_read_safely() -> None:
    rows = torch.randn(4, 8)
    assert torch.equal(part_embeds(saved(rows), 8, 16, "p").rows, rows)
    read = part_embeds(
        {"image_embeds": saved(rows.half()), "image_grid_thw": saved(torch.tensor([1, 2, 8]))}, 8, 16, "p"
    )
    assert read == ImageEmbeds(read.rows, (1, 2, 8)) and read.rows.dtype == torch.float32
    for value, says in [
        ("not base64!", "p must be base64"),
        (saved(Payload()), "could not be read as a tensor"),
        (saved(torch.randn(17, 8)), "between 1 and 16 rows"),
        ({"image_embeds": saved(rows), "image_grid_thw": saved(Payload())}, "p.image_grid_thw could not be read"),
        ({"image_grid_thw": saved(torch.tensor([1, 2, 2]))}, "needs its image_embeds"),
        ({"image_embeds": saved(rows), "extra": "x"}, "not \\['extra'\\]"),
        ({"image_embeds": 5}, "base64 text or an object"),
        (7, "base64 text or an object"),
    ]:
        with pytest.raises(InvalidRequestError, match=says):
            part_embeds(value, 8, 16, "p")
