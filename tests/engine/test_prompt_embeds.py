"""Prompts given as input embeddings (--enable-prompt-embeds) through `sonar.open()` on a tiny
random-weight Llama: the embeddings of a prompt's tokens (transformers' embedding layer) give the
same greedy tokens as the token prompt, alone and batched with a token prompt; the prefix cache
keys them by the embeddings; the refusals (flag off, wrong shape, too long, not finite, prompt
logprobs); and `load_serialized` on base64 that is not a plain torch.save tensor."""

from __future__ import annotations

import base64
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import sonar
from sonar.engine.prompt_embeds import load_serialized
from sonar.errors import InvalidRequestError
from sonar.sampling_params import SamplingParams
from tests.http.test_admin import save_tiny_llama

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes="16M", seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = " ".join(f"w{i}" for i in (5, 17, 300, 9, 41, 77, 12, 200, 3, 64, 90, 150, 33, 8, 270, 19, 101, 6, 58, 222))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def embed(tiny: Path) -> Any:
    from transformers import AutoModelForCausalLM

    layer = AutoModelForCausalLM.from_pretrained(str(tiny)).get_input_embeddings()
    return lambda ids: layer(torch.tensor(ids)).detach()


async def test_embeddings_give_the_token_prompts_output(tiny: Path, embed: Any, one_thread: None) -> None:
    async with sonar.open(str(tiny), enable_prompt_embeds=True, **ENGINE) as llm:
        ids = await llm.tokenize(PROMPT)
        other = await llm.tokenize("w1 w2 w3 w4 w5 w6")
        by_ids = await llm.generate(ids, GREEDY)
        by_embeds = await llm.generate({"prompt_embeds": embed(ids)}, GREEDY)
        assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert len(by_embeds.prompt_token_ids) == len(ids)

        results: dict[str, Any] = {}

        async def run(name: str, prompt: Any) -> None:
            results[name] = await llm.generate(prompt, GREEDY)

        async with anyio.create_task_group() as tg:  # one batch: embedding rows beside token rows
            tg.start_soon(run, "embeds", {"prompt_embeds": embed(other).unsqueeze(0)})
            tg.start_soon(run, "tokens", ids)
            tg.start_soon(run, "again", {"prompt_embeds": embed(ids)})
        assert results["tokens"].outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert results["again"].outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert results["embeds"].outputs[0].token_ids == (await llm.generate(other, GREEDY)).outputs[0].token_ids

        # the prefix cache: the same embeddings hit it, other embeddings of that length do not,
        # and neither does a token prompt of the placeholder ids
        repeat = await llm.generate({"prompt_embeds": embed(ids)}, GREEDY)
        assert repeat.num_cached_tokens > 0
        shifted = await llm.generate({"prompt_embeds": embed(ids) + 0.01}, GREEDY)
        assert shifted.num_cached_tokens == 0
        placeholders = await llm.generate([0] * len(ids), GREEDY)
        assert placeholders.num_cached_tokens == 0
        assert placeholders.outputs[0].token_ids != by_ids.outputs[0].token_ids  # the embeddings were read

        hidden = embed(ids).shape[1]
        for prompt, params, says in [
            ({"prompt_embeds": torch.zeros(4, hidden + 1)}, GREEDY, "the model's hidden size"),
            ({"prompt_embeds": torch.zeros(300, hidden)}, GREEDY, "between 1 and 256 rows"),
            ({"prompt_embeds": torch.zeros(0, hidden)}, GREEDY, "between 1 and 256 rows"),
            ({"prompt_embeds": torch.full((4, hidden), float("nan"))}, GREEDY, "finite"),
            ({"prompt_embeds": torch.zeros(4, hidden, dtype=torch.int64)}, GREEDY, "floating-point"),
            ({"prompt_embeds": [[0.0] * hidden]}, GREEDY, "must be a tensor"),
            ({"prompt_embeds": embed(ids)}, SamplingParams(max_tokens=2, prompt_logprobs=1), "prompt's tokens"),
        ]:
            with pytest.raises(InvalidRequestError, match=says):
                await llm.generate(prompt, params)
        assert (await llm.generate(ids, GREEDY)).outputs[0].token_ids == by_ids.outputs[0].token_ids


async def test_without_the_flag_embeddings_are_refused(tiny: Path, embed: Any, one_thread: None) -> None:
    async with sonar.open(str(tiny), **ENGINE) as llm:
        with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds") as info:
            await llm.generate({"prompt_embeds": embed([5, 6])}, GREEDY)
        assert info.value.param == "prompt_embeds"


def saved(obj: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


class Payload:
    """What a hostile pickle would run on load: it must never be called."""

    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned > /dev/null",))


def test_serialized_embeddings_are_read_safely() -> None:
    tensor = torch.randn(3, 16)
    assert torch.equal(load_serialized(saved(tensor), 16, 8), tensor)
    assert load_serialized(saved(tensor.half()), 16, 8).dtype == torch.float32
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data/0", b"\0" * 10_000_000)
    for text, says in [
        ("not base64!", "must be base64"),
        (base64.b64encode(b"plain bytes").decode(), "not a torch.save file"),
        (base64.b64encode(pickle.dumps(tensor)).decode(), "not a torch.save file"),
        (saved(Payload()), "could not be read as a tensor"),
        (saved({"x": tensor}), "must be a tensor"),
        (base64.b64encode(bomb.getvalue()).decode(), "more than 128 values take"),
        (saved(torch.randn(3, 15)), r"\[tokens, 16\]"),
        (saved(torch.randn(9, 16)), "between 1 and 8 rows"),
    ]:
        with pytest.raises(InvalidRequestError, match=says):
            load_serialized(text, 16, 8)
