"""The detokenizer actor: turns each step's token ids into text deltas for the frontends.

It keeps one `IncrementalDetokenizer` per request, finds stop strings (and tells the scheduler to
finish those requests), turns logprob token ids into strings, and sends each frontend one
`Outputs` message per step with the deltas of its requests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import anyio.to_thread

from sonar.actors import Actor, ActorRef
from sonar.core.detokenize import IncrementalDetokenizer
from sonar.engine import tokenizers
from sonar.log import get_logger
from sonar.protocol.engine import (
    CountRequests,
    DescribeWorker,
    DetokenizerMsg,
    Forget,
    Logprob,
    OutputDelta,
    Outputs,
    PositionLogprobs,
    SchedulerMsg,
    StepOutputs,
    StopStringHit,
    TokenLogprobs,
    WorkerMsg,
)
from sonar.sampling_params import SamplingParams

log = get_logger("sonar.detokenizer")


@dataclass
class _Tracked:
    detok: IncrementalDetokenizer
    params: SamplingParams
    sink: ActorRef
    prompt_sent: int = 0
    """Prompt positions whose logprobs went out."""
    prompt_pass: int = 0
    """Prompt positions received in the current pass over the prompt."""

    def fresh_prompt_logprobs(self, plps: list[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """The part of one chunk's prompt logprobs not sent yet: a preempted (or recovered)
        request computes its prompt again from position 0, whose chunk starts with None."""
        if plps and plps[0] is None:
            self.prompt_pass = 0
        first = self.prompt_pass
        self.prompt_pass += len(plps)
        fresh = plps[max(0, self.prompt_sent - first) :]
        self.prompt_sent = max(self.prompt_sent, self.prompt_pass)
        return fresh


class DetokenizerActor(Actor):
    protocol = DetokenizerMsg

    def __init__(
        self, worker: ActorRef[WorkerMsg], tokenizer: str | None = None, scheduler: ActorRef[SchedulerMsg] | None = None
    ) -> None:
        self.worker = worker
        self.scheduler = scheduler
        """Where stop-string hits go (`StopStringHit`)."""
        self.tokenizer_path = tokenizer
        self.requests: dict[str, _Tracked] = {}

    async def started(self) -> None:
        path = self.tokenizer_path
        if path is None:
            info = await self.worker.ask(DescribeWorker(), timeout=60)
            path = info.tokenizer_path
        if path is None:
            raise RuntimeError("the model has no tokenizer; pass tokenizer=...")
        self.tokenizer = await anyio.to_thread.run_sync(tokenizers.load, path)

    async def handle(self, msg: DetokenizerMsg) -> Any:
        if isinstance(msg, StepOutputs):
            await self._step(msg)
        elif isinstance(msg, Forget):
            for rid in msg.request_ids:
                self.requests.pop(rid, None)
        elif isinstance(msg, CountRequests):
            return len(self.requests)
        else:
            raise TypeError(f"unexpected {type(msg).__name__}")
        return None

    async def _step(self, msg: StepOutputs) -> None:
        for t in msg.new:
            self.requests[t.req_id] = _Tracked(
                IncrementalDetokenizer.from_params(self.tokenizer, t.params, t.prompt_token_ids), t.params, t.sink
            )
        by_sink: dict[ActorRef, list[OutputDelta]] = defaultdict(list)
        hits: dict[str, str] = {}
        delivered: set[str] = set()  # requests with a delta in this step
        for u in msg.updates:
            tracked = self.requests.get(u.req_id)
            if tracked is None:
                continue  # finished by a stop string or aborted since
            finish, reason = u.finish_reason, u.stop_reason
            stop_token = finish == "stop" and isinstance(reason, int)
            update = tracked.detok.update(u.new_token_ids, final=finish is not None, stop_token=stop_token)
            # a stop string may end a multi-step decode's tokens before their last, and before
            # the stop token or length that ended the request among the later ones
            ids = u.new_token_ids if update.kept is None else u.new_token_ids[: update.kept]
            if update.stopped and (finish is None or len(ids) < len(u.new_token_ids)):
                if finish is None:
                    hits[u.req_id] = update.stop_str
                finish, reason = "stop", update.stop_str
            delta = OutputDelta(
                req_id=u.req_id,
                text=update.text,
                token_ids=list(ids),
                finish_reason=finish,
                stop_reason=reason,
                num_prompt_tokens=u.num_prompt_tokens,
                num_cached_tokens=u.num_cached_tokens,
                error=u.error,
                pooled=msg.pooled.get(u.req_id),
                timing=u.timing,
                model_time=u.model_time,
            )
            lps = msg.logprobs.get(u.req_id)
            if lps:  # a run's, past a stop token or string, are longer than the tokens kept
                delta.logprobs = [self._position(lp) for lp in lps[: len(ids)]]
            plps = msg.prompt_logprobs.get(u.req_id)
            if plps is not None and (plps := tracked.fresh_prompt_logprobs(plps)):
                delta.prompt_logprobs = [self._position(lp) if lp is not None else None for lp in plps]
            by_sink[tracked.sink].append(delta)
            delivered.add(u.req_id)
            if finish is not None:
                del self.requests[u.req_id]
        # prompt logprobs of prefill chunks that sampled nothing yet
        for rid, plps in msg.prompt_logprobs.items():
            tracked = self.requests.get(rid)
            if tracked is not None and rid not in delivered and (plps := tracked.fresh_prompt_logprobs(plps)):
                by_sink[tracked.sink].append(
                    OutputDelta(
                        req_id=rid,
                        text="",
                        token_ids=[],
                        prompt_logprobs=[self._position(lp) if lp is not None else None for lp in plps],
                    )
                )
        if hits and self.scheduler is not None:
            await self.scheduler.send(StopStringHit(hits))
        for sink, deltas in by_sink.items():
            await sink.send(Outputs(deltas))

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        tokens = self.tokenizer.convert_ids_to_tokens(lp.token_ids)
        tokens = [self.tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]
        top = [Logprob(t, s, p) for t, s, p in zip(lp.token_ids[1:], tokens[1:], lp.logprobs[1:])]
        return PositionLogprobs(lp.token_ids[0], tokens[0], lp.logprobs[0], lp.rank, top)
