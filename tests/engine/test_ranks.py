"""The ranks of a parallel group (`sonar.engine.ranks`) through the whole engine
(`sonar.open(tensor_parallel_size=..., pipeline_parallel_size=...)`): real worker processes on
gloo under their one-for-all supervisor.

* Greedy tokens equal transformers' and the single worker's for tp = 2, pp = 2 and tp x pp = 2 x 2,
  logprobs and prompt logprobs within float32 noise, seeded random sampling the same (the sampler
  samples once, from the same logits); with stages, steps of different requests overlap.
* Structured outputs at pp = 2: rank 0 passes the grammar bitmask on to the sampler, on the last stage.
* SIGKILL of a rank mid-stream: the group is rebuilt (a new rendezvous, every rank restarted) and
  all 16 requests complete with the text they have without the kill; a rank that hangs instead is
  found by a step watchdog, with the same outcome.
* What the groups cannot take yet is refused by name (KV offloading, the 'uni' backend, a remote
  placement), and shapes that do not split fail the start with the reason.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import pytest

import sonar
from sonar.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.conftest import TinyCheckpoint
from tests.models.conftest import hf_generate_batch

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_thread")]

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w42"]
NEW_TOKENS = 12
#: Logprobs of the same float32 weights, summed in another order across ranks (measured ~1e-6).
LOGPROB_ATOL = 1e-4
BASE: dict[str, Any] = {"dtype": "float32", "num_gpu_blocks_override": 64}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)


async def _run(path: Any, **args: Any) -> tuple[list[Any], list[Any], Any, Any]:
    """Greedy outputs of `TEXTS` all at once and seeded ones one by one, the engine's tree and its
    scheduler's stats."""
    async with sonar.open(str(path), **BASE, **args) as llm:
        greedy = await llm.generate_many(TEXTS, GREEDY)
        seeded = [await llm.generate(text, SEEDED) for text in TEXTS]
        return greedy, seeded, llm.tree(), await llm.stats()


def _close(a: Any, b: Any) -> bool:
    """Two positions' logprobs: the same top tokens, logprobs within `LOGPROB_ATOL`."""
    return (
        abs(a.logprob - b.logprob) < LOGPROB_ATOL
        and [t.token_id for t in a.top] == [t.token_id for t in b.top]
        and all(abs(x.logprob - y.logprob) < LOGPROB_ATOL for x, y in zip(a.top, b.top))
    )


@pytest.fixture(scope="module")
async def single(llama: TinyCheckpoint) -> tuple[list[Any], list[Any]]:
    """The single worker's outputs, checked against transformers' greedy tokens."""
    from transformers import AutoTokenizer

    greedy, seeded, _, _ = await _run(llama.path)
    expected, _ = hf_generate_batch(llama.hf, AutoTokenizer.from_pretrained(str(llama.path)), TEXTS, NEW_TOKENS)
    assert [o.token_ids for o in greedy] == expected
    return greedy, seeded


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
async def test_a_group_equals_the_single_worker(llama: TinyCheckpoint, single: Any, tp: int, pp: int) -> None:
    greedy, seeded, tree, stats = await _run(llama.path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if pp > 1:  # stage 0 started steps while the last stage still ran earlier ones
        assert stats.steps_overlapped > 0
    group = next(c for c in tree.children if c.name == "worker")
    assert group.kind == "supervisor"
    assert [c.name for c in group.children] == [f"rank{r}" for r in range(1, tp * pp)] + ["rank0"]
    assert len({c.pid for c in group.children}) == tp * pp and all(c.placement == "process" for c in group.children)
    want_greedy, want_seeded = single
    for text, a, b in zip(TEXTS, want_greedy, greedy):
        assert b.token_ids == a.token_ids, text
        assert all(_close(x, y) for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert all(_close(x, y) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
    assert [o.token_ids for o in seeded] == [o.token_ids for o in want_seeded]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
async def test_speculation_in_a_group_keeps_the_single_workers_text(
    llama: TinyCheckpoint, single: Any, tp: int, pp: int
) -> None:
    """n-gram drafts through tensor ranks (each follower keeps what the sampler keeps) and stages."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    greedy, seeded, _, stats = await _run(
        llama.path, tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=ngram
    )
    want_greedy, want_seeded = single
    assert [o.token_ids for o in greedy] == [o.token_ids for o in want_greedy]
    assert [o.token_ids for o in seeded] == [o.token_ids for o in want_seeded]
    assert stats.spec_num_draft_tokens > 0


async def test_structured_outputs_through_a_pipeline() -> None:
    """The embedded SmolLM2 as served (its Q4_1 quants; 30 layers: 15 a stage), a choice: the
    sampler applies the bitmask."""
    choices = ["Paris", "London", "Rome"]
    params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(choice=choices))
    async with sonar.open(None, pipeline_parallel_size=2) as llm:
        assert llm.info.pipeline_parallel_size == 2 and llm.info.num_layers == 15
        out = await llm.generate("The capital of France is", params)
    assert out.text == "Paris"


async def test_a_killed_rank_restarts_the_group_and_no_request_fails(llama: TinyCheckpoint) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [f"w{i} w{i + 7} w{2 * i + 1} w{i + 50}" for i in range(16)]
    # a cache too small for all 16 at once: requests are preempted and recomputed as well
    args = {**BASE, "num_gpu_blocks_override": 24, "tensor_parallel_size": 2}
    async with sonar.open(str(llama.path), **args) as llm:
        undisturbed = [o.text for o in await llm.generate_many(prompts, params)]
        group = llm.supervisor.child("worker").child
        victim = group.child("rank1")
        before = {r.name: r.pid for r in group.runners}
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = (await llm.generate(prompts[i], params)).text

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
            async for _ in llm.stream(prompts[0], params):  # the batch is decoding
                break
            os.kill(victim.pid, signal.SIGKILL)
        assert [results[i] for i in range(16)] == undisturbed
        after = {r.name: r.pid for r in llm.supervisor.child("worker").child.runners}
        assert all(after[name] != pid for name, pid in before.items()), "one-for-all restarts every rank"
        assert any(e.kind == "restart" for e in group.events)
        assert (await llm.generate(prompts[1], params)).text == undisturbed[1]


async def test_a_hung_rank_is_found_by_the_watchdog_and_the_group_restarts(llama: TinyCheckpoint, single: Any) -> None:
    """Rank 1 stops answering in step 3 while rank 0 waits on it in a collective: a step watchdog
    ends the group's process, the group restarts whole, and the requests complete unchanged."""
    args = {**BASE, "tensor_parallel_size": 2, "fault_injection": "hang@step=3@rank=1", "hang_margin": 2.0}
    async with sonar.open(str(llama.path), **args) as llm:
        greedy = await llm.generate_many(TEXTS, GREEDY)
        group = llm.supervisor.child("worker").child
        assert any(e.kind == "hung" or e.kind == "crash" for e in group.events)
        assert any(e.kind == "restart" for e in group.events)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in single[0]]


async def test_heads_that_do_not_split_fail_the_start(llama: TinyCheckpoint) -> None:
    with pytest.raises(Exception, match="tensor-parallel-size 3 does not divide the model's number of attention"):
        async with sonar.open(str(llama.path), tensor_parallel_size=3, **BASE):
            pass


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"distributed_executor_backend": "uni"}, "'uni' runs one worker"),
        ({"kv_offloading_size": 1.0}, "KV offloading with tensor_parallel_size 2"),
        ({"placement": "worker=tcp://10.0.0.1:5000"}, "remote worker placement"),
    ],
)
def test_what_tensor_parallelism_cannot_take_is_refused(args: dict[str, Any], message: str) -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig.from_args(None, tensor_parallel_size=2, **args)
