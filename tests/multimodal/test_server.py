"""Images through the real server (`python -m sonar serve`) and the OpenAI client: a tiny random
LLaVA answers a data: URL image as transformers does, a repeated image hits the prefix cache and
another image does not, and bad, huge, disallowed or too many images are 400s that leave the
server serving everyone else. The same images as `/v1/responses` input_image parts (data:, file://,
http(s)://) give the chat route's answer, also when a later turn continues the conversation."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import anyio
import httpx
import openai
import pytest
import torch

from sonar.multimodal.processor import ImageProcessor, expand_images
from sonar.protocol.engine import VisionInfo
from tests.http.conftest import ServerProcess, start_server, stop_server_cleanly
from tests.multimodal.tiny_llava import IMAGE_SIZE, IMAGE_TOKEN_ID, random_image, save_tiny_llava

MODEL = "tiny-llava"


def png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict[str, Any], text: str = "w5 w6 w7") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("media")
    (path / "a.png").write_bytes(png(random_image(3)))
    return path


@pytest.fixture(scope="module")
def media_http(media_dir: Path) -> Iterator[str]:
    """A real HTTP server over `media_dir` on 127.0.0.1: the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[tuple[ServerProcess, Path, Any]]:
    path = tmp_path_factory.mktemp("tiny-llava")
    hf = save_tiny_llava(path, seed=7)
    server = start_server(
        tmp_path_factory.mktemp("llava-server"),
        str(path),
        *("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256"),
        *("--num-gpu-blocks-override", "64", "--block-size", "16", "--seed", "0"),
        # 8 tokens a step (max_num_seqs at most 8): an image's 16 rows span steps
        *("--max-num-batched-tokens", "8", "--max-num-seqs", "2"),
        *("--enable-prompt-tokens-details", "--allowed-local-media-path", str(media_dir)),
        *("--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", '{"image": 2}', "--enable-mm-embeds"),
    )
    yield server, path, hf
    stop_server_cleanly(server)


def counters(server: ServerProcess) -> dict[str, float]:
    """The engine's step and vision tower counters, from `/metrics`."""
    names = ("sonar:engine_steps_total", "sonar:mm_encoder_runs_total", "sonar:mm_encoder_cache_hits_total")
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(names)}
    return {name.removeprefix("sonar:").removesuffix("_total"): found[name] for name in names}


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def transformers_answer(path: Path, hf: Any, images: list[Any], text: str, n: int) -> list[str]:
    """transformers' greedy answer (its words) for the chat the server renders: the template's
    text with the image token where the part was, expanded, with the same pixels."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    content = "\n".join(["<image>"] * len(images) + [text])
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    vision = VisionInfo(IMAGE_TOKEN_ID, 16, IMAGE_SIZE)  # (16 / 4) ** 2 patches, no class token
    processor = ImageProcessor(vision, path, None)
    prompt, placed = expand_images(ids, vision, [processor.pixels(im) for im in images])
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            pixel_values=torch.stack([p.pixel_values for p in placed]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return tok.decode(out[0, len(prompt) :].tolist()).split()


def test_a_data_url_image_is_answered_as_transformers_does(llava: tuple[ServerProcess, Path, Any]) -> None:
    server, path, hf = llava
    image = random_image(11)
    before = counters(server)
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(image_part(data_url(png(image)))), max_tokens=6, temperature=0
    )
    after = counters(server)
    assert reply.choices[0].message.content.split() == transformers_answer(path, hf, [image], "w5 w6 w7", 6)
    assert reply.usage.prompt_tokens == 1 + 16 + 3 + 2  # w1, the image's rows, the text, w2 w4
    # 22 prompt tokens in three steps of at most 8 (the image cut twice), five more tokens; one tower run
    assert after["engine_steps"] - before["engine_steps"] == 3 + 5
    assert after["mm_encoder_runs"] - before["mm_encoder_runs"] == 1


def test_two_images_and_a_file_url(llava: tuple[ServerProcess, Path, Any], media_dir: Path) -> None:
    server, path, hf = llava
    image = random_image(12)
    from PIL import Image

    local = Image.open(media_dir / "a.png").convert("RGB")
    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=chat(image_part(data_url(png(image))), image_part(f"file://{media_dir / 'a.png'}")),
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content.split() == transformers_answer(path, hf, [image, local], "w5 w6 w7", 4)


def test_an_allowed_http_url_is_fetched(llava: tuple[ServerProcess, Path, Any], media_http: str) -> None:
    server, path, hf = llava
    from PIL import Image

    local = Image.open(io.BytesIO(httpx.get(f"{media_http}/a.png").content)).convert("RGB")
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(image_part(f"{media_http}/a.png")), max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content.split() == transformers_answer(path, hf, [local], "w5 w6 w7", 4)


def saved(tensor: Any) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_an_image_given_as_its_features_is_answered_as_its_picture(llava: tuple[ServerProcess, Path, Any]) -> None:
    """An ``image_embeds`` part holding transformers' features of a picture (--enable-mm-embeds),
    beside an image_url part: the answer is the two pictures'."""
    server, path, hf = llava
    first, second = random_image(13), random_image(14)
    vision = VisionInfo(IMAGE_TOKEN_ID, 16, IMAGE_SIZE)
    pixels = ImageProcessor(vision, path, None).pixels(second)
    with torch.inference_mode():
        features = hf.model.get_image_features(pixel_values=pixels[None]).pooler_output[0]
    embeds = {"type": "image_embeds", "image_embeds": saved(features)}
    reply = client(server).chat.completions.create(
        model=MODEL, messages=chat(image_part(data_url(png(first))), embeds), max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content.split() == transformers_answer(path, hf, [first, second], "w5 w6 w7", 4)
    for bad, expected in [
        (saved(features[:15]), "has 15 rows"),
        (saved({"rows": features}), "takes only"),
        (saved([features]), "must be a tensor"),
        (base64.b64encode(b"\x80\x04K\x01.").decode(), "not a torch.save file"),
        ({"image_embeds": saved(features), "image_grid_thw": "@@"}, "image_grid_thw must be base64"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            client(server).chat.completions.create(
                model=MODEL, messages=chat({"type": "image_embeds", "image_embeds": bad}), max_tokens=1
            )
        assert expected in info.value.message
        assert "image_embeds" in info.value.body["param"]


def cached(reply: Any) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_the_prefix_cache_keys_blocks_by_image(llava: tuple[ServerProcess, Path, Any]) -> None:
    """The image's tokens fill the first block: the same image hits it, another image does not,
    though both prompts are the same tokens."""
    server, _, _ = llava
    api = client(server)
    first, second = data_url(png(random_image(21))), data_url(png(random_image(22)))

    def ask(url: str) -> Any:
        return api.chat.completions.create(
            model=MODEL, messages=chat(image_part(url), text="w8 w9 w10"), max_tokens=1, temperature=0
        )

    cold = ask(first)
    assert cold.usage.prompt_tokens == 22 and cached(cold) == 0
    again = ask(first)
    assert cached(again) == 16
    assert again.choices[0].message.content == cold.choices[0].message.content
    other = ask(second)
    assert cached(other) == 0


BAD = [
    ("bytes", [image_part(data_url(b"not an image at all"))], "not an image"),
    ("base64", [image_part("data:image/png;base64,@@@")], "not valid base64"),
    ("media type", [image_part(data_url(b"x", "text/plain"))], "not an image"),
    ("domain", [image_part("http://example.com/a.png")], "not allowed"),
    ("scheme", [image_part("ftp://127.0.0.1/a.png")], "data:, file:// or http(s)://"),
    ("outside", [image_part("file:///etc/hostname")], "outside"),
    ("too many", [image_part(data_url(png(random_image(1))))] * 3, "at most 2 image(s)"),
    ("detail", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,", "detail": "high"}}], "detail"),
]


@pytest.mark.parametrize("parts, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_images_are_400s(llava: tuple[ServerProcess, Path, Any], parts: list[Any], expected: str) -> None:
    server, _, _ = llava
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model=MODEL, messages=chat(*parts), max_tokens=1)
    assert expected in info.value.message


def test_a_decompression_bomb_is_a_400(llava: tuple[ServerProcess, Path, Any]) -> None:
    """A small PNG whose header declares 5000 x 5000 pixels is refused before it is decoded."""
    from PIL import Image

    bomb = png(Image.new("L", (5000, 5000)))
    assert len(bomb) < 100_000
    with pytest.raises(openai.BadRequestError) as info:
        client(server := llava[0]).chat.completions.create(
            model=MODEL, messages=chat(image_part(data_url(bomb))), max_tokens=1
        )
    assert "pixels" in info.value.message
    assert server.proc.poll() is None


def test_the_image_token_typed_as_text_is_a_400(llava: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = llava
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=MODEL, messages=chat(image_part(data_url(png(random_image(2)))), text="<image> w5"), max_tokens=1
        )
    assert "image placeholder" in info.value.message


def test_bad_requests_leave_others_unaffected(llava: tuple[ServerProcess, Path, Any]) -> None:
    """Good and bad image requests at once: the good ones are answered as alone."""
    server, path, hf = llava
    image = random_image(31)
    good = {"model": MODEL, "messages": chat(image_part(data_url(png(image)))), "max_tokens": 4, "temperature": 0}
    bad = {"model": MODEL, "messages": chat(image_part(data_url(b"\x89PNG\r\n\x1a\n broken"))), "max_tokens": 4}
    expected = transformers_answer(path, hf, [image], "w5 w6 w7", 4)
    results: list[httpx.Response] = []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:

            async def one(body: dict[str, Any]) -> None:
                results.append(await http.post("/v1/chat/completions", json=body))

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, good if i % 2 else bad)

    anyio.run(main)
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * 3 + [400] * 3
    for r in results:
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"].split() == expected
        else:
            assert "image" in r.json()["error"]["message"]
    # text-only requests to the same model still work
    reply = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    assert json.loads(reply.model_dump_json())["usage"]["prompt_tokens"] == 5


def test_tokenize_counts_an_image_as_its_rows(llava: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = llava
    r = httpx.post(
        f"{server.base_url}/tokenize",
        json={"model": MODEL, "messages": chat(image_part("data:image/png;base64,"), text="w5")},
    )
    assert r.status_code == 200
    assert r.json()["tokens"] == [1] + [IMAGE_TOKEN_ID] * 16 + [5, 2, 4]


def test_streamed_and_n2_answers_equal_the_whole_one(llava: tuple[ServerProcess, Path, Any]) -> None:
    server, path, hf = llava
    image = random_image(13)
    messages = chat(image_part(data_url(png(image))))
    expected = transformers_answer(path, hf, [image], "w5 w6 w7", 4)
    api = client(server)
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).split() == expected
    both = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, n=2)
    assert [c.message.content.split() for c in both.choices] == [expected, expected]


def input_image(url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto", **fields}


def user_input(*parts: dict[str, Any], text: str = "w5 w6 w7") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "input_text", "text": text}]}]


@pytest.mark.parametrize("kind", ["data", "file", "http"])
def test_responses_input_image_answers_as_chat_does(
    llava: tuple[ServerProcess, Path, Any], media_dir: Path, media_http: str, kind: str
) -> None:
    server, _, _ = llava
    api = client(server)
    url = {
        "data": data_url(png(random_image(31))),
        "file": f"file://{media_dir / 'a.png'}",
        "http": f"{media_http}/a.png",
    }[kind]
    answer = api.chat.completions.create(model=MODEL, messages=chat(image_part(url)), max_tokens=6, temperature=0)
    reply = api.responses.create(model=MODEL, input=user_input(input_image(url)), max_output_tokens=6, temperature=0)
    assert reply.status in ("completed", "incomplete")
    assert reply.output_text == answer.choices[0].message.content
    assert reply.usage.input_tokens == answer.usage.prompt_tokens == 1 + 16 + 3 + 2


def test_responses_continue_a_conversation_with_its_image(llava: tuple[ServerProcess, Path, Any]) -> None:
    """The stored turn keeps its image: the next turn's prompt holds it again, as a chat with the
    whole conversation does."""
    server, _, _ = llava
    api = client(server)
    url = data_url(png(random_image(32)))
    first = api.responses.create(model=MODEL, input=user_input(input_image(url)), max_output_tokens=3, temperature=0)
    second = api.responses.create(
        model=MODEL, previous_response_id=first.id, input="w8 w9", max_output_tokens=4, temperature=0
    )
    messages = [
        *chat(image_part(url)),
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "w8 w9"},
    ]
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert second.output_text == answer.choices[0].message.content
    assert second.usage.input_tokens == answer.usage.prompt_tokens


BAD_INPUT_IMAGES = [
    ("detail", [input_image(data_url(png(random_image(1))), detail="low")], "input[0].content[0].detail"),
    ("file_id", [{"type": "input_image", "file_id": "file-abc", "detail": "auto"}], "input[0].content[0].file_id"),
    ("no url", [{"type": "input_image", "detail": "auto"}], "input[0].content[0].image_url"),
    ("outside", [input_image("file:///etc/hostname")], "input[0].content[0].image_url"),
    ("bytes", [input_image(data_url(b"not an image at all"))], "input[0].content[0].image_url"),
    ("too many", [input_image(data_url(png(random_image(1))))] * 3, "input"),
]


@pytest.mark.parametrize("parts, param", [b[1:] for b in BAD_INPUT_IMAGES], ids=[b[0] for b in BAD_INPUT_IMAGES])
def test_bad_input_images_are_400s_naming_the_part(
    llava: tuple[ServerProcess, Path, Any], parts: list[Any], param: str
) -> None:
    server, _, _ = llava
    with pytest.raises(openai.BadRequestError) as info:
        client(server).responses.create(model=MODEL, input=user_input(*parts), max_output_tokens=1)
    assert info.value.body["param"] == param
    assert server.proc.poll() is None


def test_a_streamed_response_with_an_image_equals_the_whole_one(llava: tuple[ServerProcess, Path, Any]) -> None:
    server, _, _ = llava
    api = client(server)
    parts = user_input(input_image(data_url(png(random_image(33)))))
    whole = api.responses.create(model=MODEL, input=parts, max_output_tokens=5, temperature=0)
    events = list(api.responses.create(model=MODEL, input=parts, max_output_tokens=5, temperature=0, stream=True))
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.input_tokens == whole.usage.input_tokens
