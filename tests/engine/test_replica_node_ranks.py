"""Data-parallel replicas of several ranks on a headless node (`sonar.engine.nodes`,
`sonar.engine.node_agent`): two "nodes" on this machine, each a real `python -m sonar serve`
process on 127.0.0.1 with the deployment's actor keys, every replica tp = 2 (gloo): the head
(``-dp 2 -dpl 1``: API server, router, replica 0's two ranks) and a ``--headless`` node keeping one
actor host per rank of replica 1, at ``--data-parallel-rpc-port + 1 * 2 + r``, where the head's
one-for-all group supervisor of replica 1 spawns rank r.

* Requests spread over both replicas, with the greedy text of one engine of one rank (dp = 1,
  tp = 1), and ``/actors`` shows replica 1's ranks on the node.
* A headless node started for another layout (tp = 1 against the head's tp = 2) is refused by
  the head's store, naming the flags.
* SIGKILL of one of replica 1's ranks on the node under streaming requests: the head restarts the
  group in the fresh host the node's agent starts, and every request completes with the same text.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from sonar.actors.keys import keygen
from sonar.cli.parse import parse_serve_args
from tests.engine.conftest import TinyCheckpoint, greedy_texts
from tests.engine.test_nodes import _env, _stop
from tests.engine.test_replica_nodes import MAX_TOKENS, PROMPTS, _complete, _prompts_per_replica
from tests.http.conftest import ROOT, ServerProcess, free_port, start_server, stop_server

ENGINE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "64", "--seed", "0")
TP = 2


def _free_run(count: int) -> int:
    """A port P with P + 1 .. P + count - 1 free too (the head's store, the node's rank hosts)."""
    for _ in range(50):
        port = free_port()
        try:
            with ExitStack() as held:
                for offset in range(1, count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def _args(path: Path, keys: Path, port: int, tp: int = TP) -> list[str]:
    return [
        str(path),
        *ENGINE_ARGS,
        *("-tp", str(tp), "-dp", "2", "-dpl", "1"),
        *("--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)),
        *("--actor-keys", str(keys)),
    ]


def _headless(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", *args, "--headless", "--data-parallel-start-rank", "1"],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def single_texts(llama: TinyCheckpoint) -> list[str]:
    """One engine's greedy texts of `PROMPTS` (dp = 1, tp = 1, in this process)."""
    return greedy_texts(llama.path, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def nodes(
    llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, subprocess.Popen, int, Path]]:
    tmp = tmp_path_factory.mktemp("dpranks")
    keys = keygen(tmp / "keys")
    port = _free_run(1 + TP + 1)  # the store; replica 1's ranks at P + 2, P + 3
    args = _args(llama.path, keys, port)
    headless = _headless(args, tmp / "headless.log")
    try:
        head = start_server(tmp, *args, "--served-model-name", "tiny", timeout=300)
    except BaseException:
        _stop(headless)
        raise
    yield head, headless, port, tmp
    stop_server(head)
    _stop(headless)


def _rank_hosts(headless: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(headless.pid).children()


@pytest.mark.slow  # two servers of tp = 2 start (about 40 s here)
def test_replicas_of_two_ranks_on_the_head_and_the_headless_node_answer_with_one_engines_text(
    nodes: tuple[ServerProcess, subprocess.Popen, int, Path], single_texts: list[str]
) -> None:
    head, headless, port, _ = nodes
    hosts = sorted(" ".join(h.cmdline()) for h in _rank_hosts(headless))
    assert len(hosts) == TP
    assert f"tcp://127.0.0.1:{port + 2} " in hosts[0] + " " and "--expect rank0" in hosts[0]
    assert f"tcp://127.0.0.1:{port + 3} " in hosts[1] + " " and "--expect rank1" in hosts[1]

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            return list(await asyncio.gather(*(_complete(client, head.base_url, p) for p in PROMPTS[:6])))

    assert asyncio.run(run()) == single_texts[:6]
    served = _prompts_per_replica(head.base_url)
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    tree = str(httpx.get(f"{head.base_url}/actors", timeout=10).json())
    assert f"tcp://127.0.0.1:{port + 2}" in tree and f"tcp://127.0.0.1:{port + 3}" in tree


@pytest.mark.slow
def test_a_headless_node_of_another_tensor_parallel_size_is_refused(
    nodes: tuple[ServerProcess, subprocess.Popen, int, Path], llama: TinyCheckpoint
) -> None:
    """The head runs tp = 2 per replica; a node started with tp = 1 (its agent run here, from the
    parsed flags) reads the head's layout in its store and refuses at once, naming the flags,
    without touching the head's replicas."""
    from sonar.actors import keys
    from sonar.engine.node_agent import NodesError, run_data_parallel_headless

    head, _, port, tmp = nodes
    argv = [*_args(llama.path, tmp / "keys", port, tp=1), "--headless", "-dpr", "1"]
    config = parse_serve_args(argv).engine
    saved = keys.current()
    keys.configure(tmp / "keys")
    try:
        with pytest.raises(NodesError) as info:
            run_data_parallel_headless(config, str(tmp / "keys"))
    finally:
        keys.configure(saved)
    message = str(info.value)
    assert "runs 2 data-parallel replicas of tp 2 x pp 1 rank(s), this node was started for 2 " in message
    assert "of tp 1 x pp 1 rank(s)" in message and "--tensor-parallel-size" in message
    assert httpx.get(f"{head.base_url}/health", timeout=10).status_code == 200


@pytest.mark.slow  # kills a rank: the last test of the module's nodes
def test_a_killed_rank_on_the_headless_node_loses_no_request(
    nodes: tuple[ServerProcess, subprocess.Popen, int, Path], single_texts: list[str]
) -> None:
    """The group of replica 1 restarts whole on the node (one-for-all): its requests are recomputed
    there when it is back within `WORKER_LOST_AFTER`, else moved to replica 0; either way every
    stream ends with one engine's text, and replica 1 serves again afterwards."""
    head, headless, port, tmp = nodes
    victim = next(h for h in _rank_hosts(headless) if f"127.0.0.1:{port + 3}" in " ".join(h.cmdline()))
    prompts, after = PROMPTS[:8], PROMPTS[8:14]

    async def run(batch: list[str], kill: bool) -> list[str]:
        async with httpx.AsyncClient() as client:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_complete(client, head.base_url, p, streaming)) for p in batch]
            if kill:
                await asyncio.wait_for(streaming.wait(), 60)  # the batches decode
                os.kill(victim.pid, signal.SIGKILL)
                killed = time.monotonic()
            texts = list(await asyncio.gather(*tasks))
            if kill:
                recovery.append(time.monotonic() - killed)
            return texts

    recovery: list[float] = []
    assert asyncio.run(run(prompts, kill=True)) == single_texts[: len(prompts)]
    print(f"SIGKILL of a rank of the headless node's replica -> last token: {recovery[0]:.1f} s")
    assert recovery[0] < 60, recovery
    deadline = time.monotonic() + 90
    while "scheduler.worker_back" not in head.log() and time.monotonic() < deadline:
        time.sleep(0.5)
    log = head.log()
    assert "scheduler.worker_back" in log, "replica 1's group came back"
    assert "actor.restart" in log
    # the killed rank's stop (its group coming down) ended on the node's report, not its deadline
    assert "nodes.replica_host_ended" in log
    assert not [line for line in log.splitlines() if "actor.kill" in line and "actor=rank1" in line], log[-3000:]
    # each incarnation of the group met on the node (loopback there), not on the head
    node_log = (tmp / "headless.log").read_text()  # the ranks' lines may interleave: count, not split
    assert node_log.count("ranks.rendezvous") == node_log.count("rendezvous=127.0.0.1:") == 2 * TP
    fresh = _rank_hosts(headless)
    assert len(fresh) == TP and victim.pid not in [h.pid for h in fresh], "the agent started a fresh host"
    before = _prompts_per_replica(head.base_url)
    assert asyncio.run(run(after, kill=False)) == single_texts[8:14]
    assert _prompts_per_replica(head.base_url)["1"] > before["1"], "replica 1 serves again"


def test_each_rank_of_a_headless_nodes_replica_is_placed_in_its_host_there() -> None:
    """The tree of replica 2 of 3 (tp = 2 x pp = 2: 4 ranks each) on the node at 10.0.0.7: each rank
    in the host at rpc_port + 2 x 4 + rank, rank 0 and the others alike; the head's replica 0 keeps
    its ranks in processes of its own machine."""
    from sonar.actors import ChildProcess, Remote
    from sonar.engine.config import EngineConfig
    from sonar.engine.nodes import replica_site
    from sonar.engine.replicas import data_parallel_spec

    config = EngineConfig.from_args(
        None,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        data_parallel_size=3,
        data_parallel_size_local=1,
        data_parallel_address="10.0.0.1",
        data_parallel_rpc_port=13345,
        data_parallel_nodes=(("10.0.0.7", 1, 2),),
    )
    assert replica_site(config, 2, 3) == ("tcp://10.0.0.7:13356", 1, 2)
    spec = data_parallel_spec(config)
    groups = {replica.name: replica.children[0] for replica in spec.children}
    placed = {rank.name: rank.placement for rank in groups["replica2"].children}
    assert placed == {f"rank{r}": Remote(f"tcp://10.0.0.7:{13353 + r}", start_timeout=900.0) for r in range(4)}
    assert groups["replica2"].strategy == "one_for_all"
    assert all(isinstance(rank.placement, ChildProcess) for rank in groups["replica0"].children)
    assert all(rank.kwargs["own_process"] for rank in groups["replica2"].children)
