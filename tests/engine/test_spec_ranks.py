"""A draft model in a parallel group (tensor and pipeline ranks: real worker processes on gloo).

With tensor ranks the draft splits over them by default (``draft_tensor_parallel_size`` = the
target's: each rank holds its shards and its KV heads' cache, and drafts in step with the others);
with ``draft_tensor_parallel_size`` 1, or pipeline stages, it runs whole on the sampler (tensor rank
0 of the last stage), beside the target's last stage: its drafts go back with the step's result and
reach every rank as the next step's tokens. The target itself as its own draft is always right (a
split draft whose KV or logits were wrong would not be); greedy and seeded text must be the single
worker's without speculation.
"""

from __future__ import annotations

from typing import Any

import pytest

import sonar
from sonar.sampling_params import SamplingParams
from tests.engine.conftest import TinyCheckpoint

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w42"]
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def _run(path: Any, **args: Any) -> tuple[list[list[int]], list[list[int]], Any]:
    async with sonar.open(str(path), **BASE, **args) as llm:
        greedy = await llm.generate_many(TEXTS, GREEDY)
        seeded = [await llm.generate(text, SEEDED) for text in TEXTS]
        return [o.token_ids for o in greedy], [o.token_ids for o in seeded], await llm.stats()


@pytest.fixture(scope="module")
async def single(llama: TinyCheckpoint) -> tuple[list[list[int]], list[list[int]]]:
    greedy, seeded, _ = await _run(llama.path)
    return greedy, seeded


@pytest.mark.parametrize(
    ("tp", "pp", "draft_tp"), [(2, 1, None), (2, 1, 1), (1, 2, None)], ids=["tp2-split", "tp2-whole", "pp2"]
)
async def test_a_draft_model_in_a_group_keeps_the_single_workers_text(
    llama: TinyCheckpoint, single: Any, tp: int, pp: int, draft_tp: int | None
) -> None:
    draft = {
        "method": "draft_model",
        "model": str(llama.path),
        "num_speculative_tokens": 3,
        "draft_tensor_parallel_size": draft_tp,
    }
    async with sonar.open(
        str(llama.path), **BASE, tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=draft
    ) as llm:
        greedy = [o.token_ids for o in await llm.generate_many(TEXTS, GREEDY)]
        before_greedy = await llm.stats()
        seeded = [(await llm.generate(text, SEEDED)).token_ids for text in TEXTS]
        stats = await llm.stats()
    assert greedy == single[0]
    assert seeded == single[1]
    # greedy: the target as its own draft is always right
    assert before_greedy.spec_num_accepted_tokens == before_greedy.spec_num_draft_tokens > 0
    assert stats.spec_num_draft_tokens > before_greedy.spec_num_draft_tokens  # seeded rows verified drafts too


async def test_async_ngram_drafts_in_tensor_ranks_keep_the_single_workers_text(
    llama: TinyCheckpoint, single: Any
) -> None:
    """With async scheduling every tensor rank fills the draft slots from its own proposer, over the
    tokens the sampler shared: the same drafts, the same rows."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    greedy, seeded, stats = await _run(
        llama.path, tensor_parallel_size=2, async_scheduling=True, speculative_config=ngram
    )
    assert greedy == single[0]
    assert seeded == single[1]
    assert stats.spec_num_draft_tokens > 0 and stats.steps_overlapped > 0


async def test_a_draft_tensor_parallel_size_neither_one_nor_the_targets_is_refused_at_startup(
    llama: TinyCheckpoint,
) -> None:
    draft = {"model": str(llama.path), "num_speculative_tokens": 3, "draft_tensor_parallel_size": 3}
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 3 is not allowed.*--tensor-parallel-size 2"):
        async with sonar.open(str(llama.path), **BASE, tensor_parallel_size=2, speculative_config=draft):
            pass
