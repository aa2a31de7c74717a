"""Sleep mode on a real engine whose worker runs in its own process: the memory sleeping frees
is measured in that process (its resident set), and the greedy answer after waking is the one
before.

The checkpoint is a random-weight Llama saved by transformers, sized so that what sleep frees
stands out of the process's noise: ~45 MiB of float32 weights, and a KV cache (64 MiB) that the
test fills with long prompts before it sleeps (the cache's pages reach the resident set only as
requests first write them).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
import torch

import sonar
from sonar import SamplingParams
from sonar.core.sleep import SleepRefusedError, SleepState
from sonar.errors import EngineSleepingError, InvalidRequestError
from sonar.procfs import resident_bytes
from sonar.protocol.engine import GetSleepState
from tests.engine.conftest import save_word_tokenizer, spread_weights

pytestmark = pytest.mark.anyio

MiB = 2**20
VOCAB = 8192
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["w5 w17 w300 w9", "w1000 w2 w3 w4 w5 w6"]


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


def save_sized_llama(path: Path) -> Path:
    """A Llama of ~45 MiB of float32 weights with a large KV per token (4 layers x 8 KV heads x
    64 x 2 x 4 bytes = 16 KiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    spread_weights(model)
    model.save_pretrained(str(path))
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_sized_llama(tmp_path_factory.mktemp("sized-llama"))


ENGINE = dict(
    dtype="float32",
    max_model_len=2048,
    kv_cache_memory_bytes=64 * MiB,
    enable_sleep_mode=True,
    placement={"worker": "process"},
    max_num_batched_tokens=2048,
)


def long_prompt(seed: int, n: int = 1500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


async def fill_kv_cache(llm: sonar.LLM) -> None:
    """Write ~3000 distinct tokens of KV (~47 MiB): their pages enter the worker's resident set."""
    await llm.generate_many([long_prompt(1), long_prompt(2)], SamplingParams(temperature=0, max_tokens=1))


async def answers(llm: sonar.LLM) -> list[list[int]]:
    return [o.token_ids for o in await llm.generate_many(PROMPTS, GREEDY)]


def rss(pid: int) -> int:
    value = resident_bytes(pid)
    assert value is not None
    return value


async def test_sleep_frees_memory_and_wake_restores_the_answers(checkpoint: Path, one_thread) -> None:
    async with sonar.open(str(checkpoint), **ENGINE) as llm:
        pid = llm.info.pid
        before = await answers(llm)
        assert not await llm.is_sleeping()

        # level 1 on the CPU: the KV cache goes, the weights stay
        await fill_kv_cache(llm)
        awake = rss(pid)
        state = await llm.sleep(1)
        assert state == SleepState(1, ("weights", "kv_cache")) and await llm.is_sleeping()
        asleep = rss(pid)
        assert awake - asleep > 40 * MiB, (awake, asleep)
        with pytest.raises(EngineSleepingError, match="asleep"):
            await llm.generate("w1 w2", GREEDY)
        assert (await llm.sleep(1)).level == 1  # again: nothing changes
        with pytest.raises(SleepRefusedError, match="wake it up"):
            await llm.sleep(2)
        await llm.wake_up()
        assert not await llm.is_sleeping()
        assert await answers(llm) == before

        # level 2: the weights go too, and come back from the checkpoint, tag by tag
        await fill_kv_cache(llm)
        awake = rss(pid)
        await llm.sleep(2)
        asleep = rss(pid)
        assert awake - asleep > 80 * MiB, (awake, asleep)  # ~45 MiB of weights and ~47 MiB of KV
        state = await llm.wake_up(["weights"])
        assert state == SleepState(2, ("kv_cache",)) and await llm.is_sleeping()
        woken = rss(pid)
        assert woken - asleep > 40 * MiB, (asleep, woken)  # the weights are back in memory
        with pytest.raises(EngineSleepingError):
            await llm.generate("w1 w2", GREEDY)
        assert await llm.wake_up(["kv_cache"]) == SleepState()
        assert await answers(llm) == before
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


async def running(llm: sonar.LLM) -> None:
    """Until the scheduler holds a request."""
    with anyio.fail_after(10):
        while (await llm.tracked_requests())["scheduler"] == 0:
            await anyio.sleep(0.005)


async def test_sleep_waits_for_running_requests_and_refuses_new_ones(checkpoint: Path, one_thread) -> None:
    engine = {**ENGINE, "placement": {}, "kv_cache_memory_bytes": 8 * MiB, "max_model_len": 256}
    async with sonar.open(str(checkpoint), **engine) as llm:
        with pytest.raises(InvalidRequestError, match="level must be 1 or 2"):
            await llm.sleep(3)
        with pytest.raises(InvalidRequestError, match="unknown wake-up tag 'kv'"):
            await llm.wake_up(["kv"])
        long = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
        expected = (await llm.generate("w1 w2 w3", long)).token_ids

        # a drain timeout shorter than the request: refused, nothing changes
        async with anyio.create_task_group() as tg:
            results: list = []

            async def run() -> None:
                results.append(await llm.generate("w1 w2 w3", long))

            tg.start_soon(run)
            await running(llm)
            with pytest.raises(SleepRefusedError, match="still running after the drain timeout"):
                await llm.sleep(1, drain_timeout=0.05)
        assert results[0].token_ids == expected and not await llm.is_sleeping()

        # a long enough drain: the running request finishes whole, a new one is refused meanwhile
        async with anyio.create_task_group() as tg:
            results = []
            tg.start_soon(run)
            await running(llm)
            slept: list[SleepState] = []

            async def sleep() -> None:
                slept.append(await llm.sleep(1, drain_timeout=60))

            tg.start_soon(sleep)
            await anyio.sleep(0.05)
            with pytest.raises(EngineSleepingError, match="going to sleep|asleep"):
                await llm.generate("w4 w5", GREEDY)
        assert results[0].token_ids == expected and results[0].finish_reason == "length"
        assert slept[0].is_sleeping
        await llm.wake_up()
        assert (await llm.generate("w1 w2 w3", long)).token_ids == expected


async def test_the_prefix_cache_is_dropped_and_every_replica_sleeps(checkpoint: Path, one_thread) -> None:
    engine = {**ENGINE, "placement": {}, "kv_cache_memory_bytes": 8 * MiB, "max_model_len": 256}
    prompt = long_prompt(3, 64)
    one = SamplingParams(temperature=0, max_tokens=1)
    async with sonar.open(str(checkpoint), data_parallel_size=2, **engine) as llm:
        first = await llm.generate(prompt, one)
        assert (await llm.generate(prompt, one)).num_cached_tokens == 48  # its blocks but the last
        await llm.sleep(1)
        for index in range(2):
            assert (await llm._ask_sleep(index, GetSleepState(), 10)).state.is_sleeping
        for text in ("w1", "w2", "w3"):  # whichever replica the router picks
            with pytest.raises(EngineSleepingError):
                await llm.generate(text, GREEDY)
        await llm.wake_up()
        again = await llm.generate(prompt, one)
        assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids


async def test_a_worker_killed_while_asleep_comes_back_awake(checkpoint: Path, one_thread) -> None:
    async with sonar.open(str(checkpoint), **{**ENGINE, "kv_cache_memory_bytes": 8 * MiB, "max_model_len": 256}) as llm:
        before = await answers(llm)
        await llm.sleep(2)
        os.kill(llm.info.pid, signal.SIGKILL)
        with anyio.fail_after(60):  # its supervisor starts another, which loads the model: awake
            while True:  # a refused request has the scheduler ask the worker, the next one is served
                try:
                    await llm.generate("w1 w2", GREEDY)
                    break
                except EngineSleepingError:
                    await anyio.sleep(0.2)
        assert not await llm.is_sleeping()
        assert await answers(llm) == before
