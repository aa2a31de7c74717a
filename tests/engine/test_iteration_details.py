"""`iteration_details`: a step's composition as --enable-logging-iteration-details logs it."""

from __future__ import annotations

from sonar.core.outputs import ScheduledRequest, SchedulerOutput
from sonar.engine.scheduler import iteration_details


def scheduled(req_id: str, tokens: int, start: int, prompt: int, drafts: int = 0) -> ScheduledRequest:
    return ScheduledRequest(
        req_id, list(range(tokens)), start, [0], sample=True, is_new=False, num_prompt_tokens=prompt, num_drafts=drafts
    )


def test_prefill_chunks_recomputes_and_decodes_are_told_apart() -> None:
    output = SchedulerOutput(
        step_id=7,
        requests=[
            scheduled("decode", 1, start=12, prompt=10),
            scheduled("decode-with-drafts", 4, start=30, prompt=20, drafts=3),
            scheduled("second-chunk", 64, start=64, prompt=200),
            scheduled("recompute-after-preemption", 15, start=0, prompt=10),
            scheduled("new", 5, start=0, prompt=5),
        ],
        num_scheduled_tokens=89,
        preempted_req_ids=[],
        finished_req_ids=[],
    )
    assert iteration_details(output) == {
        "context_requests": 3,
        "context_tokens": 84,
        "generation_requests": 2,
        "generation_tokens": 5,
    }


def test_an_empty_step_counts_nothing() -> None:
    output = SchedulerOutput(step_id=0, requests=[], num_scheduled_tokens=0, preempted_req_ids=[], finished_req_ids=[])
    assert set(iteration_details(output).values()) == {0}
