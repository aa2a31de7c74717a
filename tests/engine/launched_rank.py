"""The script each torchrun rank runs in `tests/engine/test_launcher.py`, as an RL framework's
would: open the engine with ``external_launcher`` and generate.

    torchrun --nproc-per-node 2 tests/engine/launched_rank.py WORLD OUT_DIR

``OUT_DIR/inputs.json`` names the models (``llama``: a checkpoint folder; ``adapter``: a LoRA
adapter of it). The ranks run the checks of their WORLD in order, each its own engine (or, for
``mismatch``, the engine of the check before): each rank appends a line per check to
``OUT_DIR/rank<R>.jsonl``, ``{"check": ..., "calls": [...]}``, a call being the token ids and
texts it got or the error it raised (its class, message and seconds taken), so a rank that dies
leaves the lines of the checks it finished.

* ``pair`` (2 ranks): ``arguments`` (rank 1 opens the engine with another ``max_num_seqs``), ``tp2`` (tp = 2 with a LoRA adapter: greedy, seeded, greedy with the
  adapter), ``mismatch`` (rank 1 asks for another prompt, then both ask the same, then both give a
  token id outside the vocabulary), ``pp2`` (pp = 2 with the model as its own draft: greedy,
  rank 0's speculation counters after it, seeded, a regex), ``stall`` (rank 1 lives on but skips
  the pp engine's next call; it waits for rank 0's line before it goes on).
* ``quad`` (4 ranks): ``tp2pp2`` (greedy, seeded), then ``kill`` (rank 3 SIGKILLs itself in the
  middle of a long call; `stand_in` keeps torchrun's agent from stopping the others first).
* ``embedded`` (3 ranks): ``tp3`` (the embedded SmolLM2 in float32, 9 heads and 3 KV heads:
  greedy, seeded). Not bfloat16, which `--dtype auto` picks on CPUs with AVX512-BF16: there each
  rank's partial sums are rounded before the all-reduce, and a seeded draw may land elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio

import sonar
from sonar.sampling_params import SamplingParams, StructuredOutputsParams

TEXTS = ["w5 w17 w33 w2 w9", "w100 w250 w7", "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", "w42"]
EMBEDDED_TEXTS = ["The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
REGEX = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(w[0-9]+w7)+"))
"""Every second token w7 (the word tokenizer's tokens carry no spaces; it has no EOS to end on)."""
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "num_gpu_blocks_override": 64,
    "distributed_timeout_seconds": 20,
}
LORA: dict[str, Any] = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
VICTIM = 3
"""The rank of ``quad`` that is killed."""
CHILD = "SONAR_TEST_RANK_CHILD"
"""Set in the victim's own process, a child of the one torchrun started (`stand_in`)."""


def draft(model: str) -> dict[str, Any]:
    """The model as its own draft: every draft is right under greedy sampling."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 3}


async def _call(llm: Any, prompts: Any, params: SamplingParams, **kwargs: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        outs = await llm.generate(prompts, params, **kwargs)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"tokens": [o.token_ids for o in outs], "texts": [o.text for o in outs]}


async def _open(**args: Any) -> dict[str, Any]:
    """Open the engine (and close it): what it raised, if anything."""
    start = time.monotonic()
    try:
        async with launched(**args):
            pass
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {}


class Report:
    """This rank's lines in ``OUT_DIR/rank<R>.jsonl``."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.jsonl"

    def line(self, check: str, calls: list[dict[str, Any]], **extra: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"check": check, "calls": calls, **extra}) + "\n")

    @staticmethod
    def has(out: Path, rank: int, check: str) -> bool:
        path = out / f"rank{rank}.jsonl"
        return path.exists() and any(json.loads(line)["check"] == check for line in path.read_text().splitlines())


def launched(**args: Any) -> Any:
    return sonar.open(distributed_executor_backend="external_launcher", **args)


async def pair(rank: int, inputs: dict[str, str], out: Path, report: Report) -> None:
    llama = inputs["llama"]
    # the ranks' first meeting waits for the slowest to start: a longer timeout than the checks'
    args = {**ENGINE, "distributed_timeout_seconds": 120, "max_num_seqs": 8 + rank}
    report.line("arguments", [await _open(model=llama, **args, tensor_parallel_size=2)])
    async with launched(
        model=llama, **ENGINE, **LORA, lora_modules=[f"a={inputs['adapter']}"], tensor_parallel_size=2
    ) as llm:
        calls = [await _call(llm, TEXTS, GREEDY), await _call(llm, TEXTS, SEEDED)]
        calls.append(await _call(llm, TEXTS, GREEDY, lora="a"))
        report.line("tp2", calls)
        calls = [await _call(llm, TEXTS[rank], GREEDY), await _call(llm, TEXTS[0], GREEDY)]
        calls.append(await _call(llm, [[5, 10**6]], GREEDY))  # refused by rank 0, raised on every rank
        report.line("mismatch", calls)
    async with launched(model=llama, **ENGINE, pipeline_parallel_size=2, speculative_config=draft(llama)) as llm:
        calls = [await _call(llm, TEXTS, GREEDY)]
        stats = {}
        if llm.engine is not None:  # greedy: the model as its own draft is always right
            s = await llm.engine.stats()
            stats = {"drafted": s.spec_num_draft_tokens, "accepted": s.spec_num_accepted_tokens}
        calls += [await _call(llm, TEXTS, SEEDED), await _call(llm, TEXTS, REGEX)]
        report.line("pp2", calls, greedy_stats=stats)
        if rank == 1:  # alive, but never makes the next call: rank 0 runs into the timeout
            deadline = time.monotonic() + 3 * ENGINE["distributed_timeout_seconds"]
            while not Report.has(out, 0, "stall") and time.monotonic() < deadline:
                await anyio.sleep(0.2)
            report.line("stall", [])
        else:
            report.line("stall", [await _call(llm, TEXTS, GREEDY)])


async def quad(rank: int, inputs: dict[str, str], report: Report) -> None:
    async with launched(model=inputs["llama"], **ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        report.line("tp2pp2", [await _call(llm, TEXTS, GREEDY), await _call(llm, TEXTS, SEEDED)])
        first = await _call(llm, TEXTS[0], GREEDY)
        if rank == VICTIM:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        report.line("kill", [first, await _call(llm, TEXTS, LONG)])


async def embedded(report: Report) -> None:
    async with launched(model=None, dtype="float32", num_gpu_blocks_override=64, tensor_parallel_size=3) as llm:
        report.line("tp3", [await _call(llm, EMBEDDED_TEXTS, GREEDY), await _call(llm, EMBEDDED_TEXTS, SEEDED)])


async def main(world: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    inputs = json.loads((out / "inputs.json").read_text())
    report = Report(out, rank)
    if world == "pair":
        await pair(rank, inputs, out, report)
    elif world == "quad":
        await quad(rank, inputs, report)
    elif world == "embedded":
        await embedded(report)
    else:
        raise SystemExit(f"unknown world {world!r}")


def stand_in(out: Path) -> None:
    """The victim's process as torchrun sees it. Its rank runs in a child, which SIGKILLs itself;
    torchrun's agent stops every rank once it sees one fail, so this parent waits for the
    survivors' lines before it dies the same way."""
    subprocess.run([sys.executable, *sys.argv], env={**os.environ, CHILD: "1"})
    deadline = time.monotonic() + 3 * ENGINE["distributed_timeout_seconds"]
    while time.monotonic() < deadline and not all(Report.has(out, r, "kill") for r in range(VICTIM)):
        time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    world, out = sys.argv[1], Path(sys.argv[2])
    if world == "quad" and int(os.environ["RANK"]) == VICTIM and not os.environ.get(CHILD):
        stand_in(out)
    anyio.run(main, world, out)
