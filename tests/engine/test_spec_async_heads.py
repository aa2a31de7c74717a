"""A draft model and EAGLE, EAGLE-3 and MTP heads with async scheduling: the text of the plain
synchronous engine.

The scheduler gives a decoding request draft slots while its step is still out; the worker fills
them with the drafts its draft or head made right after that step, from the tokens it kept
(`ModelRunner.drafted`). Each engine has a token budget of 8 (prompts are prefilled in chunks)
and a KV cache small enough that a burst is preempted; greedy output and seeded sampling with
``n = 2`` must be the plain engine's, through a prefix hit, a preemption and an abort, and every
block must come back. The draft model is the target itself: every greedy draft is kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import sonar
from sonar import SamplingParams
from tests.models.test_deepseek_mtp import Mtp
from tests.models.test_eagle import reference_head
from tests.models.test_eagle import save_head as save_eagle_head
from tests.models.test_eagle3 import make_target, random_head, save_head

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

K = 3
BLOCKS = 10
PROMPTS = [
    "w5 w17 w3 w88 w41 w9",
    "w60 w2 w33 w71 w14 w60 w2 w33 w71 w14 w60 w2 w33",
    "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, n=2, ignore_eos=True)
BURST = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
COMMON: dict[str, Any] = dict(dtype="float32", max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each method's (target, speculative config)."""
    root = tmp_path_factory.mktemp("async-heads")
    llama = make_target(root / "llama")
    stack, fc = reference_head(llama, False)
    save_eagle_head(root / "eagle", stack, fc)

    def spec(method: str, model: Path | None = None) -> dict[str, Any]:
        return {"method": method, "num_speculative_tokens": K, **({"model": str(model)} if model else {})}

    return {
        "draft_model": (llama.path, spec("draft_model", llama.path)),
        "eagle": (llama.path, spec("eagle", root / "eagle")),
        "eagle3": (llama.path, spec("eagle3", save_head(root / "eagle3", random_head()))),
        "mtp": (Mtp().save(root / "mtp"), spec("mtp")),
    }


async def texts(llm: sonar.LLM, params: SamplingParams, salt: str | None = None) -> list[list[list[int]]]:
    outs = [await llm.generate(p, params, cache_salt=salt) for p in PROMPTS]
    return [[c.token_ids for c in out.outputs] for out in outs]


_plain: dict[Path, dict[str, Any]] = {}


async def plain(path: Path) -> dict[str, Any]:
    """The plain synchronous engine's text for `path` (once per target)."""
    if path not in _plain:
        async with sonar.open(str(path), num_gpu_blocks_override=64, **COMMON) as llm:
            _plain[path] = {
                "greedy": await texts(llm, GREEDY),
                "seeded": await texts(llm, SEEDED),
                "burst": [o[0] for o in await texts(llm, BURST)],
            }
    return _plain[path]


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp"])
async def test_async_drafts_from_the_worker_keep_the_plain_text(method: str, setups: dict[str, Any]) -> None:
    path, spec = setups[method]
    expected = await plain(path)
    async with sonar.open(
        str(path),
        num_gpu_blocks_override=BLOCKS,
        max_num_batched_tokens=16,  # four drafting decodes a step: the burst below preempts
        max_num_seqs=8,
        async_scheduling=True,
        speculative_config=spec,
        **COMMON,
    ) as llm:
        assert await texts(llm, GREEDY) == expected["greedy"]  # the longest prompt prefilled in 2 chunks
        again = await llm.generate(PROMPTS[2], GREEDY)
        assert again.num_cached_tokens > 0 and [again.outputs[0].token_ids] == expected["greedy"][2]
        greedy = await llm.stats()
        assert greedy.steps_overlapped > 0  # the loop is async indeed
        assert greedy.spec_num_draft_tokens > 0
        if method == "draft_model":  # the target as its own draft is always right
            assert greedy.spec_num_accepted_tokens == greedy.spec_num_draft_tokens
        assert await texts(llm, SEEDED) == expected["seeded"]

        got: dict[tuple[int, int], list[int]] = {}

        async def one(i: int, j: int) -> None:  # a salt each: no block shared
            out = await llm.generate(PROMPTS[i], BURST, cache_salt=f"salt-{i}-{j}")
            got[i, j] = out.outputs[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                for j in range(2):
                    tg.start_soon(one, i, j)
        assert got == {(i, j): expected["burst"][i] for i in range(len(PROMPTS)) for j in range(2)}
        assert (await llm.stats()).num_preemptions > 0

        seen = 0
        async for _ in llm.stream(PROMPTS[1], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)):
            seen += 1
            if seen == 3:  # drafts in flight: the request is aborted
                break
        assert await texts(llm, GREEDY, salt="after-abort") == expected["greedy"]
        with anyio.fail_after(30):
            while (await llm.stats()).num_running:
                await anyio.sleep(0.05)
        assert (await llm.stats()).num_free_blocks == BLOCKS
        assert await llm.tracked_requests() == {"frontend": 0, "scheduler": 0, "detokenizer": 0}


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
async def test_a_worker_crash_with_drafts_in_flight_loses_no_text(method: str, setups: dict[str, Any]) -> None:
    """The steps in flight die with the worker, and the drafts it kept: the new worker's first
    steps leave the slots empty, and the requests are recomputed from the tokens the scheduler has."""
    path, spec = setups[method]
    expected = await plain(path)
    async with sonar.open(
        str(path),
        num_gpu_blocks_override=BLOCKS,
        async_scheduling=True,
        speculative_config=spec,
        fault_injection="raise@step=4",
        **COMMON,
    ) as llm:
        assert await texts(llm, GREEDY) == expected["greedy"]
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1
        assert (await llm.stats()).spec_num_draft_tokens > 0
