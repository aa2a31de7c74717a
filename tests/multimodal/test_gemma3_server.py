"""Gemma 3 with images through the real server (`python -m sonar serve`) and the OpenAI client:
image parts are answered as transformers answers the same rendered chat (its image tokens
attending to each other), with prompts prefilled in steps of at most 17 tokens, which the
scheduler ends before an image rather than inside it; a repeated image hits the prefix cache
(the hit ends inside the image: the next step computes the image's remaining tokens) and
another image does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from sonar.models.gemma3_vl import IMAGE_TEXT
from sonar.multimodal.gemma3 import Gemma3ImageProcessor
from sonar.multimodal.processor import expand_images
from sonar.protocol.engine import VisionInfo
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly
from tests.multimodal.test_server import chat, client, data_url, image_part, png
from tests.multimodal.tiny_gemma3 import IMAGE_SIZE, IMAGE_TOKEN, TOKENS_PER_IMAGE, save_tiny_gemma3
from tests.multimodal.tiny_llava import random_image

MODEL = "tiny-gemma3"
VISION = VisionInfo(IMAGE_TOKEN, TOKENS_PER_IMAGE, IMAGE_SIZE, IMAGE_TEXT, processor="gemma3", bidirectional=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path, Any]]:
    path = tmp_path_factory.mktemp("tiny-gemma3")
    hf = save_tiny_gemma3(path, seed=11)
    server = start_server(
        tmp_path_factory.mktemp("gemma3-server"),
        str(path),
        *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--block-size", "16", "--seed", "0"),
        *("--enable-prompt-tokens-details", "--limit-mm-per-prompt", '{"image": 2}'),
        *("--max-num-batched-tokens", "17", "--max-num-seqs", "4"),  # a prompt's first step ends before its image
    )
    yield server, path, hf
    stop_server_cleanly(server)


def transformers_answer(path: Path, hf: Any, images: list[Any], text: str, n: int) -> tuple[list[str], int]:
    """transformers' greedy answer (its words) for the chat the server renders, and the prompt's length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    content = "\n".join([IMAGE_TEXT] * len(images) + [text])
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    processor = Gemma3ImageProcessor(VISION, path, None)
    prompt, placed = expand_images(ids, VISION, [processor.pixels(im) for im in images])
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            pixel_values=torch.stack([p.pixel_values for p in placed]),
            token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN) for t in prompt]]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    # the server leaves special tokens (<end_of_image>, which a random model may pick) out of the text
    return tok.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True).split(), len(prompt)


@pytest.mark.parametrize("sizes", [[(40, 24)], [(24, 40), (56, 32)]], ids=["one-image", "two-images"])
def test_images_are_answered_as_transformers_does(gemma: tuple[ServerProcess, Path, Any], sizes: list[Any]) -> None:
    server, path, hf = gemma
    images = [random_image(10 + i, size) for i, size in enumerate(sizes)]
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(*(image_part(data_url(png(im))) for im in images)), max_tokens=6, temperature=0
    )
    words, prompt_tokens = transformers_answer(path, hf, images, "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == words
    assert reply.usage.prompt_tokens == prompt_tokens


def test_a_repeated_image_hits_the_prefix_cache(gemma: tuple[ServerProcess, Path, Any]) -> None:
    server, path, hf = gemma
    api = client(server)
    image = random_image(21, (40, 40))
    first, second = data_url(png(image)), data_url(png(random_image(22, (40, 40))))

    def ask(url: str, text: str) -> Any:
        return api.chat.completions.create(
            model=MODEL, messages=chat(image_part(url), text=text), max_tokens=4, temperature=0
        )

    cold = ask(first, "w8 w9 w10")
    # w1 <boi> 16 image tokens <eoi> w8 w9 w10 w2 w4
    assert cold.usage.prompt_tokens == 1 + 1 + TOKENS_PER_IMAGE + 1 + 3 + 2
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    # the same image before other text: the hit (block 0) ends after 14 of the image's tokens
    warm = ask(first, "w11 w12 w13")
    assert warm.usage.prompt_tokens_details.cached_tokens == 16
    assert warm.choices[0].message.content.split() == transformers_answer(path, hf, [image], "w11 w12 w13", 4)[0]
    assert ask(second, "w8 w9 w10").usage.prompt_tokens_details.cached_tokens == 0
