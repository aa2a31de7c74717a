"""The engine under faults, through the library: injected worker faults are recovered with the
same output; a scheduler or detokenizer crash ends the requests it held with `EngineDeadError`
(never a hang) and the engine serves the next ones; fault plans parse as documented."""

from __future__ import annotations

import time

import anyio
import pytest

import sonar
from sonar import SamplingParams
from sonar.engine.config import EngineConfig
from sonar.engine.faults import Fault, FaultPlan, FaultSpecError

pytestmark = pytest.mark.anyio

ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Two plus two equals", "My favourite animal is the"]


def test_fault_plans_parse_and_fire_as_documented() -> None:
    plan = FaultPlan.parse("raise@step=3, hang@p=0")
    assert plan is not None and plan.faults == [Fault("raise", step=3), Fault("hang", probability=0.0)]
    assert [plan.next_step() for _ in range(5)] == [None, None, "raise", None, None]  # once
    always = FaultPlan.parse("exit@p=1")
    assert always is not None and [always.next_step() for _ in range(3)] == ["exit"] * 3
    assert FaultPlan.parse("") is None and FaultPlan.parse(None) is None
    for bad in ("boom@step=1", "raise", "raise@step=0", "raise@p=2", "raise@when=3", "hang@step=x"):
        with pytest.raises(FaultSpecError):
            FaultPlan.parse(bad)
    with pytest.raises(ValueError, match="fault"):
        EngineConfig.from_args(None, fault_injection="raise@soon")


def test_a_token_fault_fires_on_every_step_whose_input_holds_the_token() -> None:
    plan = FaultPlan.parse("raise@token=13")
    assert plan is not None and plan.faults == [Fault("raise", token=13)]
    assert plan.next_step([[1, 2], [3]]) is None
    assert plan.next_step([[1, 2], [5, 13, 7]]) == "raise"
    assert plan.next_step([[13]]) == "raise"  # again: each recompute of a poison prompt fails
    assert plan.next_step() is None
    for bad in ("raise@token=-1", "raise@token=x"):
        with pytest.raises(FaultSpecError, match="token"):
            FaultPlan.parse(bad)


async def test_an_in_process_worker_that_hangs_is_restarted_and_the_output_is_unchanged(one_thread) -> None:
    async with sonar.open(**ENGINE) as llm:
        reference = [o.token_ids for o in await llm.generate_many(PROMPTS, PARAMS)]
    async with sonar.open(**ENGINE, fault_injection="hang@step=5", hang_margin=1.0) as llm:
        t0 = time.monotonic()
        outs = await llm.generate_many(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == reference
        worker = next(c for c in llm.tree().children if c.name == "worker")
        assert worker.restarts == 1 and worker.last_exit == "crash"
        assert time.monotonic() - t0 < 60
        crash = next(e for e in llm.supervisor.events if e.kind == "crash")
        assert crash.child == "worker"


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
async def test_a_crash_of_a_stateful_actor_ends_its_requests_with_an_error_then_serves(one_thread, victim) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with sonar.open(**ENGINE) as llm:
        failures: list[BaseException] = []

        async def doomed() -> None:
            try:
                await llm.generate(PROMPTS[0], long)
            except sonar.EngineDeadError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(doomed)
            stream = llm.stream(PROMPTS[1], long)
            async for _ in stream:  # the requests are running
                break
            await llm.supervisor.child(victim).fail("killed by the test")
            with anyio.fail_after(10), pytest.raises(sonar.EngineDeadError, match=victim):
                async for _ in stream:
                    pass
        assert len(failures) == 1 and victim in str(failures[0])
        runner = llm.supervisor.child(victim)
        with anyio.fail_after(30):
            while runner.state != "running":
                await anyio.sleep(0.05)
        out = await llm.generate(PROMPTS[2], PARAMS)  # the restarted engine serves
        assert len(out.token_ids) == PARAMS.max_tokens and runner.restarts == 1


def test_a_fault_can_name_the_rank_that_carries_it_out() -> None:
    plan = FaultPlan.parse("hang@step=2@rank=1,raise@token=9")
    assert plan is not None and [f.rank for f in plan.faults] == [1, 0]
    assert plan.next_fault() is None
    fault = plan.next_fault()
    assert fault is not None and (fault.action, fault.rank) == ("hang", 1)
    with pytest.raises(FaultSpecError, match="only @rank=R"):
        FaultPlan.parse("exit@p=0.5@node=1")
    with pytest.raises(ValueError, match="names rank 1, but the worker has 1 rank"):
        EngineConfig.from_args(None, fault_injection="exit@step=1@rank=1")
