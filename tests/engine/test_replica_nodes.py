"""Data-parallel replicas over several nodes (`sonar.engine.nodes`, `sonar.engine.node_agent`): two
"nodes" on this machine, each a real `python -m sonar serve` process on 127.0.0.1 with the
deployment's actor keys: the head (``-dp 2 -dpl 1``: API server, router, replica 0) and a
``--headless`` node running replica 1 (``--data-parallel-start-rank 1``), whose worker the head
spawns in the actor host the node keeps at ``--data-parallel-rpc-port + 1``.

* Requests spread over both replicas (each replica's ``engine``-labelled metrics count prompts),
  the greedy text equals one engine's, and ``/actors`` shows replica 1's worker on the node.
* SIGKILL of the headless node's replica host under 16 streaming requests: replica 1's supervisor
  on the head restarts its worker in the fresh host the node's agent starts, the scheduler
  recomputes what was in flight, and all 16 complete with the undisturbed text.
* A connection without the deployment's keys is refused; a headless node that does not fit the
  head (another layout, a replica another node runs) is refused, and a head whose nodes never
  come fails its start in time, each naming the flags; the layouts Sonar cannot run are refused
  by name, before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgspec
import psutil
import pytest

from sonar.actors.keys import keygen
from sonar.cli.errors import UsageError
from sonar.cli.parse import parse_serve_args
from sonar.engine.config import EngineConfig
from sonar.engine.nodes import replica_site
from tests.engine.conftest import TinyCheckpoint, greedy_texts
from tests.engine.test_nodes import MAX_TOKENS, PROMPTS, _env, _stop, _two_free_ports
from tests.http.conftest import ROOT, ServerProcess, free_port, start_server, stop_server

ENGINE_ARGS = ("--dtype", "float32", "--num-gpu-blocks-override", "64", "--seed", "0")


def _dp_args(path: Path, keys: Path, port: int) -> list[str]:
    return [
        str(path),
        *ENGINE_ARGS,
        *("-dp", "2", "-dpl", "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)),
        *("--actor-keys", str(keys)),
    ]


@pytest.fixture(scope="module")
def single_texts(llama: TinyCheckpoint) -> list[str]:
    """One engine's greedy texts of `PROMPTS` (dp = 1, in this process)."""
    return greedy_texts(llama.path, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def two_nodes(
    llama: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, subprocess.Popen, int]]:
    tmp = tmp_path_factory.mktemp("dpnodes")
    keys = keygen(tmp / "keys")
    port = _two_free_ports()
    args = _dp_args(llama.path, keys, port)
    with (tmp / "headless.log").open("wb") as log:
        headless = subprocess.Popen(
            [sys.executable, "-m", "sonar", "serve", *args, "--headless", "--data-parallel-start-rank", "1"],
            cwd=ROOT,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        head = start_server(tmp, *args, "--served-model-name", "tiny", timeout=240)
    except BaseException:
        _stop(headless)
        raise
    yield head, headless, port
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


def _prompts_per_replica(base: str) -> dict[str, float]:
    """Prompt tokens each replica looked up in its prefix cache (its ``engine`` label: its index)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.findall(r'^sonar:prefix_cache_queries_total\{engine="(\d+)"[^}]*\} (\S+)$', text, re.M)
    return {engine: float(value) for engine, value in found}


@pytest.mark.slow  # two servers start (about 30 s here)
def test_requests_spread_over_the_heads_and_the_headless_nodes_replicas(
    two_nodes: tuple[ServerProcess, Any, int], single_texts: list[str]
) -> None:
    head, headless, port = two_nodes
    hosts = psutil.Process(headless.pid).children()
    assert len(hosts) == 1 and f"tcp://127.0.0.1:{port + 1}" in hosts[0].cmdline()

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            return list(await asyncio.gather(*(_complete(client, head.base_url, p) for p in PROMPTS[:6])))

    assert asyncio.run(run()) == single_texts[:6]
    served = _prompts_per_replica(head.base_url)
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    tree = str(httpx.get(f"{head.base_url}/actors", timeout=10).json())
    assert "replica1" in tree and f"tcp://127.0.0.1:{port + 1}" in tree


@pytest.mark.slow
def test_a_killed_replica_on_the_headless_node_loses_no_request(
    two_nodes: tuple[ServerProcess, Any, int], single_texts: list[str]
) -> None:
    head, headless, _ = two_nodes
    victim = psutil.Process(headless.pid).children()[0]
    before = _prompts_per_replica(head.base_url)

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_complete(client, head.base_url, p, streaming)) for p in PROMPTS]
            await asyncio.wait_for(streaming.wait(), 60)  # the batches decode
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            texts = list(await asyncio.gather(*tasks))
            recovery.append(time.monotonic() - killed)
            return texts

    recovery: list[float] = []
    assert asyncio.run(run()) == single_texts
    print(f"SIGKILL of the replica's host -> last token: {recovery[0]:.1f} s")
    # the node's agent reported the ended host: no wait for the worker's 15 s ping deadline (here
    # 5-11 s from the kill to the last token, depending on the machine's load; about 25 s with it)
    assert "nodes.replica_host_ended" in head.log() and "actor.hung" not in head.log()
    assert recovery[0] < 60, recovery
    fresh = psutil.Process(headless.pid).children()
    assert len(fresh) == 1 and fresh[0].pid != victim.pid, "the node's agent started a fresh host for its replica"
    assert "actor.restart" in head.log() and "scheduler.worker_back" in head.log()
    after = _prompts_per_replica(head.base_url)
    assert after["1"] > 0 and after["0"] > before["0"], (before, after)


@pytest.mark.slow
def test_a_connection_without_the_deployments_keys_is_refused(
    two_nodes: tuple[ServerProcess, Any, int], tmp_path: Path
) -> None:
    """Another deployment's keys (a client key the node never authorized) reach nothing at the
    replica's actor host: the spawn is never answered."""
    _, _, port = two_nodes
    probe = (
        "import anyio, sys\n"
        "from sonar.actors import configure_transport, ActorRef\n"
        "from sonar.actors.host import HOST_NAME, HostMsg\n"
        "from sonar.actors.messages import AskTimeout\n"
        "from sonar.actors.host import Kill\n"
        f"configure_transport({str(keygen(tmp_path / 'other'))!r}, None)\n"
        "async def main():\n"
        f"    host = ActorRef(HOST_NAME, HostMsg, 'tcp://127.0.0.1:{port + 1}')\n"
        "    try:\n"
        "        await host.ask(Kill(name='worker'), timeout=3)\n"
        "    except AskTimeout:\n"
        "        print('refused')\n"
        "anyio.run(main)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "refused", out.stderr


@pytest.mark.slow  # kills the headless node: the last test of the module's two nodes
def test_a_lost_headless_node_moves_its_requests_to_the_heads_replica(
    two_nodes: tuple[ServerProcess, Any, int], single_texts: list[str]
) -> None:
    """The whole node dies (its agent and its host, SIGKILL): nobody reports the host, but its
    beats stop, so the head fails the worker after `NODE_SILENT`; its restart waits for a host that
    never comes, and after `WORKER_LOST_AFTER` the frontend moves replica 1's requests to replica 0,
    where their replays go on where the client's streams stopped: every request ends with one
    engine's greedy text."""
    head, headless, _ = two_nodes
    node = psutil.Process(headless.pid)
    victims = [node, *node.children(recursive=True)]

    async def run() -> list[str]:
        async with httpx.AsyncClient() as client:
            streaming = asyncio.Event()
            tasks = [asyncio.create_task(_complete(client, head.base_url, p, streaming)) for p in PROMPTS]
            await asyncio.wait_for(streaming.wait(), 60)
            for victim in victims:
                victim.kill()
            killed = time.monotonic()
            texts = list(await asyncio.gather(*tasks))
            recovery.append(time.monotonic() - killed)
            return texts

    recovery: list[float] = []
    assert asyncio.run(run()) == single_texts
    print(f"SIGKILL of the whole headless node -> last token: {recovery[0]:.1f} s")
    assert "frontend.request_moved" in head.log() and "nodes.replica_node_silent" in head.log()
    assert recovery[0] < 60, recovery  # NODE_SILENT, then WORKER_LOST_AFTER: far from the 900 s start timeout


DP = ["-dp", "2", "-dpl", "1", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-dp", "2", "-dpl", "1"], "--data-parallel-address is needed"),
        (["-dp", "2", "-dpl", "1", "--data-parallel-address", "10.0.0.1"], "--data-parallel-rpc-port is needed"),
        (["-dp", "2", "-dpl", "3"], "--data-parallel-size-local must be in 1..2"),
        ([*DP, "-dpr", "2", "--headless"], "--data-parallel-start-rank 2 + --data-parallel-size-local 1 must be"),
        ([*DP, "-dpr", "1"], "argument --data-parallel-start-rank: a node whose replicas start at 1 runs no API"),
        ([*DP, "--headless"], "argument --headless: runs the ranks or replicas of a secondary node"),
        (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address takes effect only with replicas on"),
        (["-dp", "2", "--data-parallel-rpc-port", "13345"], "--data-parallel-rpc-port takes effect only with"),
        ([*DP[:-1], "65535"], "up to 65536, which must be a port"),
        ([*DP[:-1], "65533", "-tp", "2"], "+ i x (--tensor-parallel-size x --pipeline-parallel-size) + r, up to 65536"),
        ([*DP, "-tp", "2", "--nnodes", "2"], "--data-parallel-size 2 with --nnodes 2 is not supported: --nnodes"),
        (
            [*DP, "-tp", "2", "--distributed-executor-backend", "ray"],
            "on each, not by --distributed-executor-backend ray",
        ),
        (
            [*DP, "--data-parallel-backend", "ray"],
            "--data-parallel-size-local 1 is not supported with --data-parallel-backend ray",
        ),
    ],
)
def test_replica_layouts_sonar_cannot_run_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_serve_args(argv)
    assert message in str(info.value)


def test_the_head_and_a_headless_node_parse() -> None:
    head = parse_serve_args(DP).engine
    assert (head.data_parallel_size_local, head.data_parallel_start_rank) == (1, 0)
    node = parse_serve_args([*DP, "--headless", "--data-parallel-start-rank", "1"])
    assert node.headless and node.engine.data_parallel_start_rank == 1


def test_each_replica_runs_here_or_on_the_node_that_reported_it() -> None:
    config = EngineConfig.from_args(
        None,
        data_parallel_size=5,
        data_parallel_size_local=2,
        data_parallel_address="10.0.0.1",
        data_parallel_rpc_port=13345,
        data_parallel_nodes=(("10.0.0.7", 2, 3),),
    )
    assert replica_site(config, 1) == (None, 1, 2)
    assert replica_site(config, 2) == ("tcp://10.0.0.7:13347", 0, 3)
    assert replica_site(config, 4) == ("tcp://10.0.0.7:13349", 2, 3)
    assert replica_site(EngineConfig.from_args(None, data_parallel_size=2), 1) == (None, 1, 2)
    with pytest.raises(ValueError, match="not by the library"):
        replica_site(msgspec.structs.replace(config, data_parallel_nodes=()), 3)


def _headless_against(store_port: int, keys: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [*DP[:-3], "127.0.0.1", "--data-parallel-rpc-port", str(store_port), "--actor-keys", str(keys)]
    return subprocess.run(
        [sys.executable, "-m", "sonar", "serve", "--headless", "-dpr", "1", *argv, *extra],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_headless_node_that_does_not_fit_the_head_is_refused(tmp_path: Path) -> None:
    """Against a head's store (held here): a node started for another -dp, then a node for a replica
    another node already runs, each refuses at once, naming the flags, and reports nothing."""
    import torch.distributed as dist

    from sonar.engine.nodes import DP_LAYOUT_KEY, HEAD_KEY, replica_key

    keys = keygen(tmp_path / "keys")
    port = _two_free_ports()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.set(HEAD_KEY, "1")
    store.set(DP_LAYOUT_KEY, "3 data-parallel replicas of tp 1 x pp 1 rank(s)")
    proc = _headless_against(port, keys)
    assert proc.returncode == 1
    assert "runs 3 data-parallel replicas of tp 1 x pp 1 rank(s), this node was started for 2" in proc.stderr
    assert "--data-parallel-size" in proc.stderr and not store.check([replica_key(1)])

    store.set(DP_LAYOUT_KEY, "2 data-parallel replicas of tp 1 x pp 1 rank(s)")
    store.set(replica_key(1), "10.0.0.9 1 1")
    proc = _headless_against(port, keys)
    assert proc.returncode == 1
    assert "replica 1 already runs on the node at 10.0.0.9" in proc.stderr
    assert "--data-parallel-start-rank" in proc.stderr


def test_a_head_whose_nodes_never_come_fails_the_start_in_time(llama: TinyCheckpoint, tmp_path: Path) -> None:
    keys = keygen(tmp_path / "keys")
    args = [*_dp_args(llama.path, keys, _two_free_ports()), "--distributed-timeout-seconds", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", *args, "--port", str(free_port())],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "no headless node came for data-parallel replica(s) 1 of --data-parallel-size 2" in proc.stderr
    assert "--distributed-timeout-seconds" in proc.stderr and "--headless" in proc.stderr
