"""Qwen2.5-VL and Qwen3-VL through the real server (`python -m sonar serve`) and the OpenAI client:
image parts of different sizes are answered as transformers answers the same rendered chat
(prompts prefilled in chunks of 8 tokens, so an image's rows, with Qwen3-VL's DeepStack rows,
span several engine steps, as the server's step counter shows, with one tower run per image); a repeated image hits the prefix cache and another does not; a
bad image is a 400 (the other bad inputs are LLaVA's tests: the request path is the same)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import torch

from sonar.models.qwen2_vl import IMAGE_TEXT
from sonar.multimodal.processor import expand_images, image_processor
from sonar.protocol.engine import VisionInfo
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly
from tests.multimodal.test_server import chat, client, counters, data_url, image_part, png
from tests.multimodal.tiny_llava import random_image
from tests.multimodal.tiny_qwen2_vl import IMAGE_PAD, MERGE, PATCH, TEMPORAL, save_tiny_qwen2_5_vl

MODEL = "tiny-qwen-vl"
VISION = VisionInfo(IMAGE_PAD, 0, 0, IMAGE_TEXT, PATCH, MERGE, TEMPORAL)


def serve_tiny_qwen(tmp_path_factory: pytest.TempPathFactory, family: str) -> tuple[ServerProcess, Path, Any]:
    """A tiny `family` checkpoint (`save_tiny_qwen2_5_vl`) behind a real server that prefills in
    chunks of 8 tokens; the server, the checkpoint's folder and the transformers model."""
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    hf = save_tiny_qwen2_5_vl(path, seed=9, family=family)
    # an 8-token step budget needs max_num_seqs at most 8
    chunked = ("--max-num-batched-tokens", "8", "--max-num-seqs", "2")
    server = start_server(
        tmp_path_factory.mktemp("qwen-vl-server"),
        str(path),
        *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--block-size", "16", "--seed", "0"),
        *("--enable-prompt-tokens-details", "--limit-mm-per-prompt", '{"image": 2}', *chunked),
    )
    return server, path, hf


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path, Any]]:
    server, path, hf = serve_tiny_qwen(tmp_path_factory, request.param)
    yield server, path, hf
    stop_server_cleanly(server)


def transformers_answer(path: Path, hf: Any, images: list[Any], text: str, n: int) -> tuple[list[str], int]:
    """transformers' greedy answer (its words) for the chat the server renders, and the prompt's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    content = "\n".join([IMAGE_TEXT] * len(images) + [text])
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    processor = image_processor(VISION, path, None)
    prompt, placed = expand_images(ids, VISION, [processor.pixels(im) for im in images])
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            pixel_values=torch.cat([p.pixel_values for p in placed]),
            image_grid_thw=torch.tensor([p.grid for p in placed]),
            mm_token_type_ids=torch.tensor([[int(t == IMAGE_PAD) for t in prompt]]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tok.decode(out[0, len(prompt) :].tolist()).split(), len(prompt)


@pytest.mark.parametrize("sizes", [[(40, 24)], [(24, 40), (56, 32)]], ids=["one-image", "two-images"])
def test_images_are_answered_as_transformers_does(qwen: tuple[ServerProcess, Path, Any], sizes: list[Any]) -> None:
    server, path, hf = qwen
    images = [random_image(10 + i, size) for i, size in enumerate(sizes)]
    before = counters(server)
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(*(image_part(data_url(png(im))) for im in images)), max_tokens=6, temperature=0
    )
    after = counters(server)
    words, prompt_tokens = transformers_answer(path, hf, images, "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == words
    assert reply.usage.prompt_tokens == prompt_tokens
    # the prompt took a step per 8 tokens (and one per later token), the tower one run per image
    assert after["engine_steps"] - before["engine_steps"] == -(-prompt_tokens // 8) + 5
    assert after["mm_encoder_runs"] - before["mm_encoder_runs"] == len(images)


def test_the_prefix_cache_keys_blocks_by_image(qwen: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = qwen
    api = client(server)
    first, second = (data_url(png(random_image(seed, (40, 40)))) for seed in (21, 22))

    def ask(url: str) -> Any:
        return api.chat.completions.create(
            model=MODEL, messages=chat(image_part(url), text="w8 w9 w10"), max_tokens=2, temperature=0
        )

    cold = ask(first)
    assert cold.usage.prompt_tokens == 1 + 27 + 3 + 2 and cold.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(first)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].message.content == cold.choices[0].message.content
    assert ask(second).usage.prompt_tokens_details.cached_tokens == 0


def test_a_bad_image_is_a_400(qwen: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = qwen
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=MODEL, messages=chat(image_part(data_url(b"not an image at all"))), max_tokens=1
        )
    assert "not an image" in info.value.message
    assert server.proc.poll() is None


def test_a_prefix_hit_inside_an_image_is_answered_as_transformers_does(qwen: tuple[ServerProcess, Path, Any]) -> None:
    """The same image before other text: the hit ends inside the image's rows (block 0 of 16
    tokens), so the step after it embeds the image's remaining rows (Qwen3-VL: with their
    DeepStack rows) at their M-RoPE positions."""
    server, path, hf = qwen
    api = client(server)
    image = random_image(23, (40, 40))
    url = data_url(png(image))
    api.chat.completions.create(model=MODEL, messages=chat(image_part(url), text="w8 w9 w10"), max_tokens=1)
    reply = api.chat.completions.create(
        model=MODEL, messages=chat(image_part(url), text="w11 w12 w13"), max_tokens=5, temperature=0
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == 16
    words, _ = transformers_answer(path, hf, [image], "w11 w12 w13", 5)
    assert reply.choices[0].message.content.split() == words
