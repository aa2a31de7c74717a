"""Qwen3-VL MoE through the real server (`python -m sonar serve`) and the OpenAI client: a chat
with an image is answered as transformers answers the same rendered chat, its prompt prefilled in
chunks of 8 tokens (the image's rows and their DeepStack rows over several steps, through sparse
and dense layers) with one tower run. The rest of the request path is the other Qwen-VL families'
(`tests/multimodal/test_qwen2_vl_server.py`, whose server this test starts)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http.conftest import stop_server_cleanly
from tests.multimodal.test_qwen2_vl_server import MODEL, serve_tiny_qwen, transformers_answer
from tests.multimodal.test_server import chat, client, counters, data_url, image_part, png
from tests.multimodal.tiny_llava import random_image


@pytest.mark.slow  # a server's start: 47 s on the shared 2-core machine
def test_an_image_chat_is_answered_as_transformers_does(tmp_path_factory: Any) -> None:
    server, path, hf = serve_tiny_qwen(tmp_path_factory, "qwen3_vl_moe")
    try:
        image = random_image(12, (40, 24))
        before = counters(server)
        reply = client(server).chat.completions.create(
            model=MODEL, messages=chat(image_part(data_url(png(image)))), max_tokens=6, temperature=0
        )
        after = counters(server)
    finally:
        stop_server_cleanly(server)
    words, prompt_tokens = transformers_answer(path, hf, [image], "w5 w6 w7", 6)
    assert reply.choices[0].message.content.split() == words
    assert reply.usage.prompt_tokens == prompt_tokens
    assert after["engine_steps"] - before["engine_steps"] == -(-prompt_tokens // 8) + 5
    assert after["mm_encoder_runs"] - before["mm_encoder_runs"] == 1
