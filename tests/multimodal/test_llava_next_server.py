"""LLaVA-NeXT through the real server (`python -m sonar serve`) and the OpenAI client, its prompts
prefilled in chunks of 16 tokens (an image's 52 or 56 rows span several engine steps): a wide and
a tall picture are answered as transformers answers the same rendered chat; a repeated picture
hits the prefix cache and another does not; transformers' feature rows of a picture
(``image_embeds``) give the picture's answer. `--media-io-kwargs` on real servers: an RGBA picture
is laid over the configured background color, and ``image_mode`` L answers as for the grey picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from sonar.multimodal.processor import expand_images, image_processor
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly
from tests.multimodal.test_server import cached, chat, client, counters, data_url, image_part, png, saved
from tests.multimodal.test_server import transformers_answer as llava_answer
from tests.multimodal.tiny_llava import random_image, save_tiny_llava
from tests.multimodal.tiny_llava_next import TALL, WIDE, batched_tiles, save_tiny_llava_next

MODEL = "tiny-llava-next"
BACKGROUND = (0, 0, 255)


@pytest.fixture(scope="module")
def next_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path, Any]]:
    path = tmp_path_factory.mktemp("tiny-llava-next")
    hf = save_tiny_llava_next(path, seed=5)
    server = start_server(
        tmp_path_factory.mktemp("llava-next-server"),
        str(path),
        *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--block-size", "16", "--seed", "0", "--max-num-batched-tokens", "16"),
        *("--max-num-seqs", "2"),  # a 16-token step budget needs max_num_seqs at most 16
        *("--enable-prompt-tokens-details", "--limit-mm-per-prompt", '{"image": 2}', "--enable-mm-embeds"),
        *("--media-io-kwargs", '{"image": {"rgba_background_color": [0, 0, 255]}}'),
    )
    yield server, path, hf
    stop_server_cleanly(server)


def _vision(path: Path) -> Any:
    from sonar.models.loader import load_model

    return load_model(str(path), dtype="float32").model.vision_info()


def transformers_answer(path: Path, hf: Any, images: list[Any], text: str, n: int) -> tuple[list[str], int]:
    """transformers' greedy answer (its words) for the chat the server renders, with the tiles
    transformers' processor makes, and the prompt's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    content = "\n".join(["<image>"] * len(images) + [text])
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    vision = _vision(path)
    processor = image_processor(vision, path, None)
    prompt, placed = expand_images(ids, vision, [processor.pixels(im) for im in images])
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            **batched_tiles(placed),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tok.decode(out[0, len(prompt) :].tolist()).split(), len(prompt)


@pytest.mark.parametrize("sizes", [[WIDE], [TALL], [TALL, WIDE]], ids=["wide", "tall", "both"])
def test_pictures_of_two_aspect_ratios_are_answered_as_transformers_does(
    next_server: tuple[ServerProcess, Path, Any], sizes: list[Any]
) -> None:
    server, path, hf = next_server
    # pictures of their own (no prefix hit from another case), so every prompt token is computed
    images = [random_image(30 + 10 * len(sizes) + i, size) for i, size in enumerate(sizes)]
    before = counters(server)
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(*(image_part(data_url(png(im))) for im in images)), max_tokens=6, temperature=0
    )
    after = counters(server)
    words, prompt_tokens = transformers_answer(path, hf, images, "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == words
    assert reply.usage.prompt_tokens == prompt_tokens
    # a step per 16 prompt tokens (and one per later token), one tower pass per picture
    assert cached(reply) == 0
    assert after["engine_steps"] - before["engine_steps"] == -(-prompt_tokens // 16) + 5
    assert after["mm_encoder_runs"] - before["mm_encoder_runs"] == len(images)


def test_a_repeated_picture_hits_the_prefix_cache(next_server: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = next_server
    api = client(server)
    first, second = (data_url(png(random_image(seed, WIDE))) for seed in (41, 42))

    def ask(url: str) -> Any:
        return api.chat.completions.create(
            model=MODEL, messages=chat(image_part(url), text="w8 w9 w10"), max_tokens=2, temperature=0
        )

    cold = ask(first)
    assert cold.usage.prompt_tokens == 1 + 52 + 3 + 2 and cached(cold) == 0
    again = ask(first)
    assert cached(again) == 48  # three full blocks of 16
    assert again.choices[0].message.content == cold.choices[0].message.content
    assert cached(ask(second)) == 0


def test_a_pictures_feature_rows_give_its_answer(next_server: tuple[ServerProcess, Path, Any]) -> None:
    """transformers' rows for a picture (base, unpadded tiles, newlines) as an ``image_embeds``
    part beside an image_url part: the answer is the two pictures'."""
    server, path, hf = next_server
    first, second = random_image(43, WIDE), random_image(44, TALL)
    tiles, size = image_processor(_vision(path), path, None).pixels(second)
    with torch.inference_mode():
        rows = hf.model.get_image_features(pixel_values=tiles[None], image_sizes=torch.tensor([size])).pooler_output[0]
    embeds = {"type": "image_embeds", "image_embeds": saved(rows)}
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(image_part(data_url(png(first))), embeds), max_tokens=4, temperature=0
    )
    words, prompt_tokens = transformers_answer(path, hf, [first, second], "w5 w6 w7", 4)
    assert reply.choices[0].message.content.split() == words
    assert reply.usage.prompt_tokens == prompt_tokens


def test_an_rgba_picture_is_laid_over_the_configured_background(next_server: tuple[ServerProcess, Path, Any]) -> None:
    from PIL import Image

    server, path, hf = next_server
    picture = random_image(45, WIDE).convert("RGBA")
    picture.putalpha(Image.linear_gradient("L").resize(WIDE))  # transparent at the top, opaque below
    over = Image.new("RGB", WIDE, BACKGROUND)
    over.paste(picture, mask=picture.getchannel("A"))
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(image_part(data_url(png(picture)))), max_tokens=6, temperature=0
    )
    words, _ = transformers_answer(path, hf, [over], "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == words
    white = Image.new("RGB", WIDE, (255, 255, 255))
    white.paste(picture, mask=picture.getchannel("A"))
    assert transformers_answer(path, hf, [white], "w5 w6 w7", 6)[0] != words  # the color reached the tower


@pytest.fixture(scope="module")
def grey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path, Any]]:
    path = tmp_path_factory.mktemp("tiny-llava-grey")
    hf = save_tiny_llava(path, seed=7)
    server = start_server(
        tmp_path_factory.mktemp("llava-grey-server"),
        str(path),
        *("--served-model-name", "tiny-llava", "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--block-size", "16", "--seed", "0"),
        *("--media-io-kwargs.image.image_mode", "L"),
    )
    yield server, path, hf
    stop_server_cleanly(server)


def test_image_mode_l_answers_as_for_the_grey_picture(grey_server: tuple[ServerProcess, Path, Any]) -> None:
    server, path, hf = grey_server
    image = random_image(46)
    reply = client(server).chat.completions.create(
        model="tiny-llava", messages=chat(image_part(data_url(png(image)))), max_tokens=6, temperature=0
    )
    grey = llava_answer(path, hf, [image.convert("L").convert("RGB")], "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == grey
    assert llava_answer(path, hf, [image], "w5 w6 w7", 6) != grey
