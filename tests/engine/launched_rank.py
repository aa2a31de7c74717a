"""The script each torchrun rank runs in `tests/engine/test_launcher.py`, as an RL framework's
would: open the engine with ``external_launcher`` and generate.

    torchrun --nproc-per-node 2 tests/engine/launched_rank.py SCENARIO MODEL OUT_DIR

MODEL: a checkpoint folder, or ``embedded``. Each rank writes ``OUT_DIR/rank<R>.json``: per call,
the token ids and texts it got, or the error it raised (its class, message, and seconds taken).
Scenarios: ``same`` (greedy, then seeded sampling, one call each); ``mismatch`` (rank 1 asks for
another prompt, then both ask the same, then both give a token id outside the vocabulary); ``kill`` (rank 1 SIGKILLs itself in the middle of a
long call); ``stall`` (rank 1 lives on but skips the second call).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio

import sonar
from sonar.sampling_params import SamplingParams

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w42"]
EMBEDDED_TEXTS = ["The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "num_gpu_blocks_override": 64,
    "distributed_timeout_seconds": 20,
}


async def _call(llm: Any, prompts: Any, params: SamplingParams) -> dict[str, Any]:
    start = time.monotonic()
    try:
        outs = await llm.generate(prompts, params)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs]}


async def main(scenario: str, model: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    embedded = model == "embedded"
    texts = EMBEDDED_TEXTS if embedded else TEXTS
    args = {"num_gpu_blocks_override": 64} if embedded else ENGINE
    calls = []
    async with sonar.open(
        None if embedded else model,
        **args,
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=int(os.environ["WORLD_SIZE"]),
    ) as llm:
        if scenario == "same":
            calls.append(await _call(llm, texts, GREEDY))
            calls.append(await _call(llm, texts, SEEDED))
        elif scenario == "mismatch":
            calls.append(await _call(llm, texts[rank % len(texts)], GREEDY))
            calls.append(await _call(llm, texts[0], GREEDY))
            calls.append(await _call(llm, [[5, 10**6]], GREEDY))  # refused by rank 0, raised on every rank
        elif scenario == "kill":
            calls.append(await _call(llm, texts[0], GREEDY))
            if rank == 1:
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
            calls.append(await _call(llm, texts, LONG))
        elif scenario == "stall":
            calls.append(await _call(llm, texts[0], GREEDY))
            if rank == 1:  # alive, but never makes the second call
                await anyio.sleep(2.5 * ENGINE["distributed_timeout_seconds"])
            else:
                calls.append(await _call(llm, texts, GREEDY))
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "calls": calls}))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], Path(sys.argv[3]))
