"""Tensor parallelism over several nodes without Ray (`sonar.engine.nodes`, `sonar.engine.node_agent`):
two "nodes" on this machine, each a real `python -m sonar serve` process (the head, node 0, and a
`--headless` node 1) on 127.0.0.1 with the deployment's actor keys, tp = 2 split across them, gloo.

* The head's answer over HTTP equals the single worker's greedy text (tp = 1, in this process).
* SIGKILL of the headless node's rank (its actor host) under 16 streaming requests: the head's
  one-for-all group restarts, the node's agent starts a fresh host, the group meets anew, and all
  16 complete with the undisturbed text.
* The head's SIGTERM stops the headless node too; a node that never comes fails the head's start
  within --distributed-timeout-seconds with a message naming it; the layouts Sonar cannot run, and
  the flags that would do nothing, are refused by name.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from sonar.actors import ChildProcess, Remote
from sonar.actors.keys import keygen
from sonar.cli.errors import UsageError
from sonar.cli.parse import parse_serve_args
from sonar.engine.config import EngineConfig
from sonar.engine.nodes import NodePlan, rank_placement
from tests.engine.conftest import TinyCheckpoint, greedy_texts
from tests.http.conftest import ROOT, ServerProcess, free_port, start_server, stop_server

PROMPTS = [f"w{i} w{i + 7} w{2 * i + 1} w{i + 50}" for i in range(16)]
MAX_TOKENS = 24
ENGINE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "64", "--seed", "0")


def _two_free_ports() -> int:
    """A port P with P + 1 free too (the head's store, the headless node's rank 1)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _node_args(path: Path, keys: Path, port: int) -> list[str]:
    return [
        str(path),
        *ENGINE_ARGS,
        *("-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)),
        *("--actor-keys", str(keys)),
    ]


def _start_headless(tmp: Path, args: list[str]) -> subprocess.Popen:
    with (tmp / "headless.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", *args, "--headless", "--node-rank", "1"],
            cwd=ROOT,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def single_texts(llama: TinyCheckpoint) -> list[str]:
    """The single worker's greedy texts of `PROMPTS` (tp = 1, in this process)."""
    return greedy_texts(llama.path, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def two_nodes(
    llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, subprocess.Popen]]:
    tmp = tmp_path_factory.mktemp("nodes")
    keys = keygen(tmp / "keys")
    args = _node_args(llama.path, keys, _two_free_ports())
    headless = _start_headless(tmp, args)
    try:
        head = start_server(tmp, *args, "--served-model-name", "tiny", timeout=240)
    except BaseException:
        _stop(headless)
        raise
    yield head, headless
    stop_server(head)
    _stop(headless)


async def _complete(client: httpx.AsyncClient, base: str, prompt: str, streaming: asyncio.Event | None = None) -> str:
    """A streamed greedy completion's text (`streaming` is set at its first token)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    text = ""
    async with client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                if streaming is not None:
                    streaming.set()
    return text


@pytest.mark.slow  # two servers start (about 40 s here)
def test_two_nodes_answer_as_one_worker(two_nodes: tuple[ServerProcess, Any], single_texts: list[str]) -> None:
    head, headless = two_nodes
    assert headless.poll() is None
    rank_hosts = psutil.Process(headless.pid).children()
    assert len(rank_hosts) == 1 and "--listen" in rank_hosts[0].cmdline()

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            return list(await asyncio.gather(*(_complete(client, head.base_url, p) for p in PROMPTS[:4])))

    assert asyncio.run(run()) == single_texts[:4]
    tree = httpx.get(f"{head.base_url}/actors", timeout=10).json()
    assert '"rank1"' in str(tree).replace("'", '"') and "tcp://127.0.0.1:" in str(tree)


@pytest.mark.slow
def test_a_killed_rank_on_the_headless_node_loses_no_request(
    two_nodes: tuple[ServerProcess, Any], single_texts: list[str]
) -> None:
    head, headless = two_nodes
    victim = psutil.Process(headless.pid).children()[0]

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_complete(client, head.base_url, p, streaming)) for p in PROMPTS]
            await asyncio.wait_for(streaming.wait(), 60)  # the batch decodes
            os.kill(victim.pid, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    assert asyncio.run(run()) == single_texts
    fresh = psutil.Process(headless.pid).children()
    assert len(fresh) == 1 and fresh[0].pid != victim.pid, "the node's agent started a fresh host for its rank"
    assert "actor.restart" in head.log() and "scheduler.worker_back" in head.log()


@pytest.mark.slow
def test_a_rank_host_that_comes_back_late_still_takes_the_spawn(
    two_nodes: tuple[ServerProcess, Any], single_texts: list[str]
) -> None:
    """The node's agent is paused while its rank's host is killed, so the head's restarted group
    spawns the rank (and rank 0 calls it in) before anything listens there: both wait in the
    transport until the agent's fresh host is up, and the group comes back in one restart."""
    head, headless = two_nodes
    victim = psutil.Process(headless.pid).children()[0]
    restarts = head.log().count("actor.restart ")
    os.kill(headless.pid, signal.SIGSTOP)
    try:
        os.kill(victim.pid, signal.SIGKILL)

        async def run() -> str:
            async with httpx.AsyncClient() as client:
                task = asyncio.create_task(_complete(client, head.base_url, PROMPTS[0]))
                await asyncio.sleep(15)  # past the group's restart: its spawn waits for a host
                os.kill(headless.pid, signal.SIGCONT)
                return await task

        assert asyncio.run(run()) == single_texts[0]
    finally:
        os.kill(headless.pid, signal.SIGCONT)
    assert head.log().count("actor.restart ") - restarts == 2, "one restart of the group (two ranks)"
    assert "restart_failed" not in head.log()


@pytest.mark.slow
def test_the_heads_shutdown_stops_the_headless_node(two_nodes: tuple[ServerProcess, Any]) -> None:
    head, headless = two_nodes
    hosts = psutil.Process(headless.pid).children()
    assert stop_server(head) == 0
    headless.wait(30)
    assert all(not h.is_running() or h.status() == psutil.STATUS_ZOMBIE for h in hosts)


def test_a_node_that_never_comes_fails_the_start_in_time(llama: TinyCheckpoint, tmp_path: Path) -> None:
    keys = keygen(tmp_path / "keys")
    args = _node_args(llama.path, keys, _two_free_ports())
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sonar",
            "serve",
            *args,
            "--port",
            str(free_port()),
            "--distributed-timeout-seconds",
            "2",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert time.monotonic() - started < 60
    assert "node(s) 1 of --nnodes 2 did not arrive" in proc.stderr
    assert "--distributed-timeout-seconds" in proc.stderr and "--headless" in proc.stderr


def test_a_headless_node_without_a_head_gives_up_in_time(llama: TinyCheckpoint, tmp_path: Path) -> None:
    keys = keygen(tmp_path / "keys")
    args = _node_args(llama.path, keys, _two_free_ports())
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", *args, "--headless", "--node-rank", "1"]
        + ["--distributed-timeout-seconds", "2"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "no head answered at 127.0.0.1:" in proc.stderr and "--distributed-timeout-seconds" in proc.stderr


def test_a_headless_node_of_another_layout_is_refused(llama: TinyCheckpoint, tmp_path: Path) -> None:
    """The head runs 2 ranks over 2 nodes; a node started with -tp 4 would wait for ranks that never
    come: it refuses at once, naming the flags."""
    import torch.distributed as dist

    from sonar.engine.nodes import LAYOUT_KEY

    keys = keygen(tmp_path / "keys")
    port = _two_free_ports()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set(LAYOUT_KEY, "2 ranks over 2 nodes")  # what a head with -tp 2 --nnodes 2 says
    argv = [str(llama.path), "-tp", "4", "--nnodes", "2", "--master-port", str(port), "--actor-keys", str(keys)]
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", *argv, "--headless", "--node-rank", "1"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "runs 2 ranks over 2 nodes, this node was started for 4 ranks over 2 nodes" in proc.stderr
    assert not store.check(["sonar/node/1"]), "a node that does not fit never reports to the head"


def test_a_head_without_the_deployments_keys_is_refused(llama: TinyCheckpoint) -> None:
    args = [str(llama.path), *ENGINE_ARGS, "-tp", "2", "--nnodes", "2", "--master-port", str(_two_free_ports())]
    env = {k: v for k, v in _env().items() if not k.startswith("SONAR_ACTOR_")}
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", *args, "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "the deployment's actor keys" in proc.stderr and "--actor-keys" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--headless"], "argument --headless: runs the ranks or replicas of a secondary node"),
        (["-tp", "2", "--nnodes", "2", "--headless"], "node 0 (--node-rank 0) is the head"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "node 1 runs no API server (node 0 does): add --headless"),
        (["-tp", "3", "--nnodes", "2"], "--nnodes 2 must divide the ranks evenly"),
        (["--nnodes", "2"], "there is one rank"),
        (["-tp", "2", "-pp", "2", "--nnodes", "2"], "--pipeline-parallel-size 2 over --nnodes 2 is not supported"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--headless"], "--node-rank must be in 0..1"),
        (["-tp", "2", "--nnodes", "2", "-dp", "2"], "--data-parallel-size 2 with --nnodes 2 is not supported"),
        (["--master-addr", "10.0.0.2"], "argument --master-addr: takes effect only with --nnodes > 1"),
        (["--master-port", "1234"], "argument --master-port: takes effect only with --nnodes > 1"),
        (["-tp", "2", "--nnodes", "2", "--data-parallel-address", "10.0.0.1"], "--data-parallel-address takes"),
    ],
)
def test_node_layouts_sonar_cannot_run_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_serve_args(argv)
    assert message in str(info.value)


def test_ranks_split_evenly_and_in_order_over_the_nodes() -> None:
    plan = NodePlan(nnodes=2, node_rank=1, world_size=4, master_addr="10.0.0.1", master_port=29501)
    assert [plan.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [plan.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert list(plan.ranks_of(1)) == [2, 3]
    assert plan.host_address(3, "10.0.0.7") == "tcp://10.0.0.7:29504"
    config = EngineConfig.from_args(None, tensor_parallel_size=4, nnodes=2, node_hosts=("10.0.0.7",))
    local = ChildProcess()
    assert rank_placement(config, 1, local, 900) is local
    assert rank_placement(config, 2, local, 900) == Remote("tcp://10.0.0.7:29503", start_timeout=900)
    with pytest.raises(ValueError, match="not by the library"):
        rank_placement(EngineConfig.from_args(None, tensor_parallel_size=4, nnodes=2), 2, local, 900)
