"""torchrun's ranks (``distributed_executor_backend="external_launcher"``, `sonar.engine.launcher`).

Real ``torchrun --nproc-per-node N`` (``python -m torch.distributed.run``) runs
`tests/engine/launched_rank.py` in every rank, as an RL framework would run its script:

* every rank gets the single worker's greedy tokens and seeded samples (tiny random Llama, tp = 2;
  the embedded SmolLM2, 9 heads and 3 KV heads, at tp = 3: the same text on each rank);
* ranks that ask for different prompts all fail with `RequestMismatchError`, and the next call
  that agrees runs; a request rank 0 refuses is raised on every rank;
* a rank SIGKILLed in the middle of a call ends the other's call with `RankLostError` within the
  collective timeout (torchrun's agent is told to look only once a minute, so the surviving rank
  must find out by itself); a rank that lives on but skips a call ends the other's call within
  the timeout too.

What the ranks cannot take is refused by name; so are a missing torchrun environment, a WORLD_SIZE
that is not the model's ranks (and the flag on ``sonar serve``: tests/cli/test_support.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import sonar
from sonar.engine.launcher import LaunchedRank, LauncherError
from tests.engine import launched_rank
from tests.engine.conftest import TinyCheckpoint
from tests.http.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(launched_rank.__file__)
TIMEOUT = launched_rank.ENGINE["distributed_timeout_seconds"]
ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def torchrun(tmp: Path, nproc: int, scenario: str, model: str, timeout: float = 600) -> tuple[int, list[dict]]:
    """Run the rank script under torchrun; its exit code and each rank's calls (None: no file)."""
    out = tmp / scenario
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    argv += [f"--master-port={free_port()}", "--monitor-interval=60", str(SCRIPT), scenario, model, str(out)]
    log = tmp / f"{scenario}.log"
    with log.open("wb") as sink:
        proc = subprocess.run(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout)
    results = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text())["calls"] if path.exists() else None)
    if proc.returncode != 0 and scenario != "kill":
        print(log.read_text()[-6000:])
    return proc.returncode, results


@pytest.fixture(scope="module")
def llama(tiny_engine_checkpoints: dict[str, TinyCheckpoint]) -> TinyCheckpoint:
    return tiny_engine_checkpoints["llama3"]  # 4 query heads, 2 KV heads: one KV head per rank


def _single(model: str | None, texts: list[str], args: dict[str, Any]) -> list[list[list[int]]]:
    """The single worker's token ids for the script's two calls of the `same` scenario."""
    import anyio

    async def run() -> list[list[list[int]]]:
        async with sonar.open(model, **args) as llm:
            calls = []
            for params in (launched_rank.GREEDY, launched_rank.SEEDED):
                calls.append([o.token_ids for o in await llm.generate_many(texts, params)])
            return calls

    return anyio.run(run)


def test_the_environment_names_the_rank() -> None:
    assert LaunchedRank.from_environ(ENV, 2) == LaunchedRank(rank=1, world_size=2, local_rank=1, local_world_size=2)
    with pytest.raises(LauncherError, match="missing here: MASTER_ADDR, MASTER_PORT.*torchrun --nproc-per-node 2"):
        LaunchedRank.from_environ({k: v for k, v in ENV.items() if not k.startswith("MASTER")}, 2)
    with pytest.raises(LauncherError, match=r"WORLD_SIZE=2, but the model's ranks .* are 4"):
        LaunchedRank.from_environ(ENV, 4)
    with pytest.raises(LauncherError, match="must be integers"):
        LaunchedRank.from_environ({**ENV, "RANK": "one"}, 2)


@pytest.mark.anyio
async def test_outside_torchrun_the_start_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LauncherError, match="runs under torchrun.*missing here: RANK"):
        async with sonar.open(None, distributed_executor_backend="external_launcher", tensor_parallel_size=2):
            pass


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
        ({"async_scheduling": True}, "async_scheduling"),
        ({"enable_sleep_mode": True}, "enable_sleep_mode"),
        ({"kv_offloading_size": 1.0}, "KV offloading"),
        ({"placement": "worker=process"}, "a worker placement"),
        ({"data_parallel_size": 2}, "data_parallel_size > 1"),
    ],
)
def test_what_torchruns_ranks_cannot_take_is_refused(args: dict[str, Any], message: str) -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"'external_launcher' does not support {message}"):
        EngineConfig.from_args(None, distributed_executor_backend="external_launcher", tensor_parallel_size=2, **args)


@pytest.mark.slow
def test_every_rank_gets_the_single_workers_tokens(llama: TinyCheckpoint, tmp_path: Path) -> None:
    want = _single(str(llama.path), launched_rank.TEXTS, launched_rank.ENGINE)
    code, ranks = torchrun(tmp_path, 2, "same", str(llama.path))
    assert code == 0
    for calls in ranks:
        assert [call["tokens"] for call in calls] == want
    assert ranks[0] == ranks[1]  # the texts too


@pytest.mark.slow
def test_the_embedded_model_over_three_ranks(tmp_path: Path) -> None:
    want = _single(None, launched_rank.EMBEDDED_TEXTS, {"num_gpu_blocks_override": 64})
    code, ranks = torchrun(tmp_path, 3, "same", "embedded")
    assert code == 0
    for calls in ranks:
        assert [call["tokens"] for call in calls] == want
    assert ranks[0] == ranks[1] == ranks[2]


@pytest.mark.slow
def test_ranks_that_ask_differently_fail_clearly(llama: TinyCheckpoint, tmp_path: Path) -> None:
    code, ranks = torchrun(tmp_path, 2, "mismatch", str(llama.path))
    assert code == 0
    for calls in ranks:
        assert calls[0]["error"] == "RequestMismatchError"
        assert "rank(s) 1 differ from rank 0's; every torchrun rank must call generate" in calls[0]["message"]
        assert calls[0]["seconds"] < TIMEOUT
    assert ranks[0][1] == ranks[1][1] and len(ranks[0][1]["tokens"][0]) == launched_rank.GREEDY.max_tokens
    # rank 0 refuses a bad request before any step; every rank raises its error
    assert ranks[0][2]["error"] == ranks[1][2]["error"] == "InvalidRequestError"
    assert ranks[0][2]["message"] == ranks[1][2]["message"] and "1000000" in ranks[0][2]["message"]


@pytest.mark.slow
def test_a_killed_rank_ends_the_others_call(llama: TinyCheckpoint, tmp_path: Path) -> None:
    started = time.monotonic()
    code, ranks = torchrun(tmp_path, 2, "kill", str(llama.path))
    assert code != 0  # rank 1 died of SIGKILL
    assert ranks[1] is None
    first, second = ranks[0]
    assert "tokens" in first
    assert second["error"] == "RankLostError" and "the torchrun world is broken" in second["message"]
    # found by the closed connection, well within the collective timeout (the kill comes 1 s in)
    assert second["seconds"] < TIMEOUT
    assert time.monotonic() - started < 600


@pytest.mark.slow
def test_a_rank_that_skips_a_call_ends_the_others_within_the_timeout(llama: TinyCheckpoint, tmp_path: Path) -> None:
    code, ranks = torchrun(tmp_path, 2, "stall", str(llama.path))
    first, second = ranks[0]
    assert "tokens" in first and ranks[1] is not None and len(ranks[1]) == 1
    assert second["error"] == "RankLostError"
    assert TIMEOUT * 0.9 < second["seconds"] < TIMEOUT + 15
