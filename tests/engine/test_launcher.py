"""torchrun's ranks (``distributed_executor_backend="external_launcher"``, `sonar.engine.launcher`).

Real torchrun (``python -m torch.distributed.run``) runs `tests/engine/launched_rank.py` in every
rank, as an RL framework would run its script. Three worlds, each started once, whose ranks run
several checks in turn and report each per rank (`launched_rank.Report`):

* ``pair``, two torchrun agents of one process each (``--nnodes 2 --node-rank 0/1``, a localhost
  rendezvous: two "nodes"): ranks that open the engine with different arguments fail as they
  meet, and the engine then opens on the same ranks; tp = 2 with a LoRA adapter and pp = 2 with a
  draft model and a regex give the single worker's greedy tokens, seeded samples and adapter
  tokens on every rank; ranks that ask for different prompts all fail with
  `RequestMismatchError`, and the next call that agrees runs; a request rank 0 refuses is raised
  on every rank; a rank that lives on but skips a call ends the other's call within the
  collective timeout.
* ``quad`` (``--nproc-per-node 4``): tp x pp = 2 x 2 gives the single worker's tokens; then a rank
  SIGKILLed in the middle of a call ends the others' call with `RankLostError`, well within the
  collective timeout (the survivors find out by themselves: `launched_rank.stand_in`).
* ``embedded`` (``--nproc-per-node 3``): the embedded SmolLM2, 9 heads and 3 KV heads, at tp = 3.

What the ranks cannot take is refused by name; so are a missing torchrun environment, a WORLD_SIZE
that is not the model's ranks (and the flag on ``sonar serve``: tests/cli/test_support.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sonar
from sonar.engine.launcher import LaunchedRank, LauncherError
from tests.engine import launched_rank
from tests.engine.conftest import TinyCheckpoint
from tests.http.conftest import free_port
from tests.lora.conftest import make_adapter

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(launched_rank.__file__)
TIMEOUT = launched_rank.ENGINE["distributed_timeout_seconds"]
ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
TEXTS = launched_rank.TEXTS


class World:
    """One torchrun world's run: its agents' exit codes, and each rank's reports."""

    def __init__(self, codes: list[int], ranks: list[dict[str, dict[str, Any]]]) -> None:
        self.codes = codes
        self.ranks = ranks

    def calls(self, check: str) -> list[list[dict[str, Any]] | None]:
        """Each rank's calls in `check` (None: the rank did not report it)."""
        return [reports[check]["calls"] if check in reports else None for reports in self.ranks]


class Torchrun:
    """The rank script's `world` under torchrun, started in the background: `nodes` agents of
    `nproc` processes each, meeting at a localhost rendezvous. The single worker's tokens are
    computed while it runs (`wait` for its `World`)."""

    def __init__(self, out: Path, world: str, nproc: int, inputs: dict[str, str], nodes: int = 1) -> None:
        out.mkdir()
        (out / "inputs.json").write_text(json.dumps(inputs))
        self.out, self.world, self.size = out, world, nproc * nodes
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--monitor-interval=0.5"]
        if nodes > 1:
            argv += [f"--nnodes={nodes}", "--master-addr=127.0.0.1"]
        argv += [f"--master-port={free_port()}"]
        self.logs = [out / f"node{node}.log" for node in range(nodes)]
        self.agents = []
        for node, log in enumerate(self.logs):
            node_args = [f"--node-rank={node}"] if nodes > 1 else []
            with log.open("wb") as sink:
                self.agents.append(
                    subprocess.Popen(
                        [*argv, *node_args, str(SCRIPT), world, str(out)],
                        env=env,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )

    def wait(self) -> World:
        try:
            codes = [agent.wait(timeout=600) for agent in self.agents]
        finally:
            self.stop()
        ranks = []
        for rank in range(self.size):
            path = self.out / f"rank{rank}.jsonl"
            lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            ranks.append({line["check"]: line for line in lines})
        if any(codes) and self.world != "quad":
            for log in self.logs:
                print(log.read_text()[-6000:])
        return World(codes, ranks)

    def stop(self) -> None:
        """End the agents still running (a SIGTERM, which each passes on to its ranks)."""
        for agent in self.agents:
            if agent.poll() is None:
                agent.terminate()
                try:
                    agent.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    agent.kill()


@pytest.fixture(scope="module")
def inputs(llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    adapter = make_adapter(llama.hf, tmp_path_factory.mktemp("adapter"), seed=1)
    return {"llama": str(llama.path), "adapter": str(adapter.path)}


def _single(model: str | None, calls: list[tuple[Any, ...]], args: dict[str, Any]) -> list[list[list[int]]]:
    """The single worker's token ids for `calls` ((prompts, params[, adapter name]) each)."""
    import anyio

    async def run() -> list[list[list[int]]]:
        async with sonar.open(model, **args) as llm:
            out = []
            for prompts, params, *lora in calls:
                outputs = await llm.generate_many(prompts, params, lora=lora[0] if lora else None)
                out.append([o.token_ids for o in outputs])
            return out

    return anyio.run(run)


def _tokens(calls: list[dict[str, Any]] | None) -> list[Any]:
    assert calls is not None, "the rank did not report the check"
    return [call.get("tokens", call.get("error")) for call in calls]


@pytest.fixture(scope="module")
def pair_run(inputs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Torchrun]:
    run = Torchrun(tmp_path_factory.mktemp("pair") / "out", "pair", 1, inputs, nodes=2)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def single(inputs: dict[str, str], pair_run: Torchrun) -> dict[str, list[list[list[int]]]]:
    """The single worker's tokens for the checks' calls, computed while the ``pair`` world runs."""
    lora = {**launched_rank.ENGINE, **launched_rank.LORA, "lora_modules": [f"a={inputs['adapter']}"]}
    calls = [(TEXTS, launched_rank.GREEDY), (TEXTS, launched_rank.SEEDED), (TEXTS, launched_rank.GREEDY, "a")]
    staged = [(TEXTS, launched_rank.GREEDY), (TEXTS, launched_rank.SEEDED), (TEXTS, launched_rank.REGEX)]
    return {
        "tp2": _single(inputs["llama"], calls, lora),
        "pp2": _single(inputs["llama"], staged, launched_rank.ENGINE),
    }


@pytest.fixture(scope="module")
def pair(pair_run: Torchrun, single: dict[str, Any]) -> World:
    return pair_run.wait()


@pytest.fixture(scope="module")
def quad(inputs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    run = Torchrun(tmp_path_factory.mktemp("quad") / "out", "quad", 4, inputs)
    try:
        yield run.wait()
    finally:
        run.stop()


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
        ({"async_scheduling": True}, "async_scheduling"),
        ({"enable_sleep_mode": True}, "enable_sleep_mode"),
        ({"kv_offloading_size": 1.0}, "KV offloading"),
        ({"placement": "worker=process"}, "a worker placement"),
        ({"data_parallel_size": 2}, "data_parallel_size > 1"),
        ({"fault_injection": "raise@step=3@rank=1"}, "fault_injection at a rank other than 0"),
    ],
)
def test_what_torchruns_ranks_cannot_take_is_refused(args: dict[str, Any], message: str) -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"'external_launcher' does not support {message}"):
        EngineConfig.from_args(None, distributed_executor_backend="external_launcher", tensor_parallel_size=2, **args)


def test_sonars_own_nodes_flag_is_refused_torchrun_spans_nodes_itself() -> None:
    from sonar.engine.config import EngineConfig

    with pytest.raises(ValueError, match="--nnodes 2 starts the ranks of each node itself"):
        EngineConfig.from_args(None, distributed_executor_backend="external_launcher", tensor_parallel_size=2, nnodes=2)


@pytest.mark.slow
def test_every_rank_gets_the_single_workers_tokens(single: dict[str, Any], pair: World) -> None:
    """tp = 2 over two torchrun "nodes", with a LoRA adapter loaded: greedy, seeded, and greedy
    with the adapter."""
    want = single["tp2"]
    assert want[2] != want[0]  # the adapter changes the tokens
    assert pair.codes == [0, 0]
    ranks = pair.calls("tp2")
    for calls in ranks:
        assert _tokens(calls) == want
    assert ranks[0] == ranks[1]  # the texts too


@pytest.mark.slow
def test_pipeline_stages_give_the_single_workers_tokens(single: dict[str, Any], pair: World, quad: World) -> None:
    """pp = 2 (with the model as its own draft, and a regex) and tp x pp = 2 x 2."""
    want = single["pp2"]
    assert all(tokens[1::2] == [7] * 6 for tokens in want[2])  # the regex: every second word w7
    ranks = pair.calls("pp2")
    for calls in ranks:
        assert _tokens(calls) == want
    assert ranks[0] == ranks[1]
    stats = pair.ranks[0]["pp2"]["greedy_stats"]
    assert stats["accepted"] == stats["drafted"] > 0  # the drafts ran, on the sampler (rank 1), and were kept
    ranks = quad.calls("tp2pp2")
    for calls in ranks:
        assert _tokens(calls) == want[:2]
    assert ranks[0] == ranks[1] == ranks[2] == ranks[3]


@pytest.mark.slow
def test_the_embedded_model_over_three_ranks(tmp_path: Path) -> None:
    texts = launched_rank.EMBEDDED_TEXTS
    run = Torchrun(tmp_path / "out", "embedded", 3, {})
    try:
        want = _single(
            None,
            [(texts, launched_rank.GREEDY), (texts, launched_rank.SEEDED)],
            {"dtype": "float32", "num_gpu_blocks_override": 64},
        )
        world = run.wait()
    finally:
        run.stop()
    assert world.codes == [0]
    ranks = world.calls("tp3")
    for calls in ranks:
        assert _tokens(calls) == want
    assert ranks[0] == ranks[1] == ranks[2]


@pytest.mark.slow
def test_ranks_that_ask_differently_fail_clearly(pair: World) -> None:
    for calls in pair.calls("arguments"):  # another engine configuration: refused as the ranks meet
        assert calls is not None and calls[0]["error"] == "LauncherError"
        assert "the engine arguments of rank(s) 1 differ from rank 0's" in calls[0]["message"]
    ranks = pair.calls("mismatch")
    for calls in ranks:
        assert calls is not None
        assert calls[0]["error"] == "RequestMismatchError"
        assert "rank(s) 1 differ from rank 0's; every torchrun rank must call generate" in calls[0]["message"]
        assert calls[0]["seconds"] < TIMEOUT
    assert ranks[0][1] == ranks[1][1] and len(ranks[0][1]["tokens"][0]) == launched_rank.GREEDY.max_tokens
    # rank 0 refuses a bad request before any step; every rank raises its error
    assert ranks[0][2]["error"] == ranks[1][2]["error"] == "InvalidRequestError"
    assert ranks[0][2]["message"] == ranks[1][2]["message"] and "1000000" in ranks[0][2]["message"]


@pytest.mark.slow
def test_a_killed_rank_ends_the_others_call(quad: World) -> None:
    assert quad.codes[0] != 0  # rank 3 died of SIGKILL
    ranks = quad.calls("kill")
    assert ranks[3] is None
    for calls in ranks[:3]:  # each survivor finds out in its own collective: rank 0's, a stage's, a step's
        assert calls is not None
        first, second = calls
        assert "tokens" in first
        assert second["error"] == "RankLostError"
        # found by the closed connection, well within the collective timeout (the kill comes 1 s in)
        assert second["seconds"] < TIMEOUT
    assert "the torchrun world is broken" in ranks[0][1]["message"]


@pytest.mark.slow
def test_a_rank_that_skips_a_call_ends_the_others_within_the_timeout(pair: World) -> None:
    first, second = pair.calls("stall")
    assert second == []  # rank 1 made no call
    assert first is not None and first[0]["error"] == "RankLostError"
    assert TIMEOUT * 0.9 < first[0]["seconds"] < TIMEOUT + 15
