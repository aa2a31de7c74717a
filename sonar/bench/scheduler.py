"""`python -m sonar bench scheduler`: what a decode step costs outside the model, part by part, as
the number of running requests grows. No model, no actors: the parts are driven directly.

For each ``--running`` count N, N requests of ``--prompt-len`` distinct prompt tokens are admitted
and prefilled, then ``--steps`` decode steps are timed. Each step does, in order, what the engine
does around the forward pass:

- ``core``: `Scheduler.schedule()` and `Scheduler.update_from_output()` with one sampled token per
  request (the scheduler actor's pure core);
- ``metadata``: `AttentionMetadata.build` of the step (the runner's input preparation on the CPU);
- ``detokenize``: `IncrementalDetokenizer.update` of every request with its token, with the
  embedded model's tokenizer (the detokenizer actor's pure core);
- ``stream``: each request's delta through its `DeltaStream` to a reader task (the path from the
  client actor to the `LLM` handle's caller).

Printed per N: the median CPU time (``time.thread_time``, of this thread: torch ops this thread
waits for on another core are not in it) of each part per step, and of all parts per step and per
request. Sampled tokens are drawn from ``--vocab`` ids with a fixed seed, so two runs do the same
work.

usage: python -m sonar bench scheduler [--running 1,16,64,256] [--steps 64] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import anyio

from sonar.core import BlockManager, Request, Scheduler, SchedulerConfig
from sonar.core.detokenize import IncrementalDetokenizer
from sonar.engine.client_actor import DeltaStream
from sonar.kernels.attention import AttentionMetadata

PARTS = ("core", "metadata", "detokenize", "stream")
BLOCK_SIZE = 16


def decoding_scheduler(n: int, prompt_len: int, steps: int, rng: random.Random, vocab: int) -> Scheduler:
    """A scheduler whose ``n`` requests have finished their prefill and decode from here on."""
    max_model_len = prompt_len + steps + 2 * BLOCK_SIZE
    per_request = -(-max_model_len // BLOCK_SIZE)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=max(n * prompt_len, 2048),
            max_num_seqs=n,
        ),
        BlockManager(n * per_request + per_request, BLOCK_SIZE),
    )
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, max_tokens=steps + 2))
    out = scheduler.schedule()
    scheduler.update_from_output({r.req_id: [rng.randrange(1, vocab)] for r in out.requests if r.sample})
    if scheduler.num_running != n or any(not r.output_token_ids for r in scheduler.running):
        raise RuntimeError(f"could not get {n} requests decoding")
    return scheduler


async def measure(n: int, prompt_len: int, steps: int, vocab: int, tokenizer: object) -> dict[str, list[float]]:
    """CPU seconds of each part, one entry per decode step."""
    rng = random.Random(n)
    scheduler = decoding_scheduler(n, prompt_len, steps, rng, vocab)
    detoks = {
        f"r{i}": IncrementalDetokenizer(tokenizer, prompt_token_ids=scheduler.requests[f"r{i}"].prompt_token_ids)
        for i in range(n)
    }
    streams = {rid: DeltaStream() for rid in detoks}
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    received = 0
    step_done = anyio.Event()
    step_target = 0

    async def read(stream: DeltaStream) -> None:
        # like the `LLM` handle's readers: the last one to get its delta of a step ends the step
        nonlocal received
        for _ in range(steps):
            await stream.receive()
            received += 1
            if received == step_target:
                step_done.set()

    clock: Callable[[], float] = time.thread_time
    async with anyio.create_task_group() as tg:
        for stream in streams.values():
            tg.start_soon(read, stream)
        await anyio.wait_all_tasks_blocked()
        for step in range(steps):
            sampled = {rid: [rng.randrange(1, vocab)] for rid in detoks}
            t0 = clock()
            out = scheduler.schedule()
            updates = scheduler.update_from_output(sampled)
            t1 = clock()
            AttentionMetadata.build(
                [len(r.token_ids) for r in out.requests],
                [r.start_pos + len(r.token_ids) for r in out.requests],
                [r.block_ids for r in out.requests],
                BLOCK_SIZE,
            )
            t2 = clock()
            texts = [(u.req_id, detoks[u.req_id].update(u.new_token_ids).text) for u in updates]
            t3 = clock()
            step_done, step_target = anyio.Event(), (step + 1) * n
            for rid, text in texts:
                streams[rid].send_nowait(text)
            await step_done.wait()
            t4 = clock()
            for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[part].append(seconds)
            if len(out.requests) != n or len(updates) != n:
                raise RuntimeError(f"step {step}: {len(out.requests)} scheduled, {len(updates)} updates, not {n}")
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sonar bench scheduler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", default="1,16,64,256", help="comma-separated running request counts")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per count")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=20000, help="sampled tokens are drawn from ids 1 .. vocab - 1")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.running.split(",")]
    if any(n <= 0 for n in counts) or args.steps <= 0 or args.prompt_len <= 0:
        ap.error("--running, --steps and --prompt-len must be positive")
    from sonar.models.embedded import load_tokenizer

    tokenizer = load_tokenizer()
    print(f"median CPU time per decode step (us), {args.steps} steps, prompts of {args.prompt_len} tokens")
    print(f"{'running':>8} " + " ".join(f"{p:>11}" for p in PARTS) + f" {'total':>11} {'per request':>12}")
    for n in counts:
        times = anyio.run(measure, n, args.prompt_len, args.steps, args.vocab, tokenizer)
        med = {part: statistics.median(v) * 1e6 for part, v in times.items()}
        total = statistics.median(sum(parts) for parts in zip(*times.values())) * 1e6
        print(f"{n:>8} " + " ".join(f"{med[p]:>11.1f}" for p in PARTS) + f" {total:>11.1f} {total / n:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
