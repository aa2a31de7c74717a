"""The I/O of several nodes (`sonar.engine.nodes` decides the layout): the head's rendezvous,
and the agent a headless node runs instead of a server.

The head (`open_head`) opens torch's `TCPStore` at ``--master-addr:--master-port`` and keeps it
for its lifetime, then waits, up to ``--distributed-timeout-seconds``, for every headless node to
leave its address there; a node that never comes fails the start with a message naming it.

A headless node (`run_headless`, ``sonar serve --headless``) checks that it shares the head's
layout (ranks, nodes), then keeps one actor host per rank of its
own (``python -m sonar actor --listen tcp://ADDR:PORT --exit-with-actor``, CURVE with the
deployment's keys), where the head's group supervisor spawns that rank. Each host lives for one
incarnation of its rank: torch.distributed holds one group per process, so when the rank ends
(the head restarts the group, or the process is killed) its host exits and the agent starts a
fresh one at the same address, which the head's next spawn reaches. The agent itself decides
nothing about the group: one-for-all supervision stays with the head. It exits when the head is
gone (its store no longer answers) or on SIGTERM, stopping its hosts.

Data-parallel replicas over several machines meet the same way at ``--data-parallel-address:
--data-parallel-rpc-port`` (`open_data_parallel_head`, `run_data_parallel_headless`): a headless
node keeps one such host per rank of each replica of its own, where the head spawns that replica's
worker (or, with ``tp x pp`` ranks, each of its ranks; the ranks meet on this node).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import keys
from sonar.engine.config import EngineConfig
from sonar.engine.nodes import (
    DP_LAYOUT_KEY,
    ENDED_KEPT,
    HEAD_KEY,
    LAYOUT_KEY,
    NODE_SILENT,
    NODE_WAIT,
    NodePlan,
    data_parallel_layout,
    host_ended_key,
    local_replicas,
    node_beat_key,
    node_key,
    replica_host_address,
    replica_key,
)
from sonar.engine.replicas import Replicas
from sonar.errors import SonarError
from sonar.log import get_logger

if TYPE_CHECKING:
    from sonar.actors import Supervisor

log = get_logger("sonar.nodes")

HOST_RESTARTS = 30
"""Restarts of one rank's host allowed within `HOST_PERIOD` seconds before the agent gives up
(each group restart is one; a host that cannot start at all loops much faster)."""
HOST_PERIOD = 60.0
HEAD_POLL = 1.0
"""Seconds between the agent's checks that the head is still there."""
ENDED_POLL = 0.2
"""Seconds between the head's looks at the hosts its headless nodes report ended."""


class NodesError(SonarError, RuntimeError):
    """A node of a multi-node deployment that did not arrive, or could not join."""


def require_keys(what: str = "--nnodes > 1 places ranks") -> None:
    """Refuse to go on with this process tree's ephemeral keys: ranks on other machines are
    reached over tcp, authenticated with the deployment's keys only."""
    if keys.current().ephemeral:
        raise NodesError(
            f"{what} on other machines: every node needs the deployment's actor keys "
            f"(python -m sonar actor keygen DIR, copied to each node; then --actor-keys DIR or {keys.ENV_DIR}=DIR)"
        )


def _store(plan: NodePlan, master: bool, timeout: float) -> "object":
    return _open_store(plan.master_addr, plan.master_port, master, timeout)


def _open_store(addr: str, port: int, master: bool, timeout: float) -> "object":
    import torch.distributed as dist

    return dist.TCPStore(
        addr,
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _await_keys(store: Any, keys: dict[int, str], wait: float) -> list[int]:
    """Wait up to `wait` seconds for every one of `keys` (by node or replica index) to be set in
    `store`; the indices still missing then."""
    missing = list(keys)
    deadline = time.monotonic() + wait
    while missing and time.monotonic() < deadline:
        missing = [k for k in missing if not store.check([keys[k]])]
        if missing:
            time.sleep(0.1)
    return missing


def open_head(config: EngineConfig) -> tuple[object, EngineConfig]:
    """The head: open the rendezvous store and wait for every headless node's address (blocking).
    Returns the store (keep it: the nodes meet there while the head runs) and `config` with the
    nodes' addresses."""
    require_keys()
    plan = NodePlan.of(config)
    wait = plan.wait_seconds(config.distributed_timeout_seconds)
    store = _store(plan, master=True, timeout=wait)
    store.set(HEAD_KEY, str(os.getpid()))
    store.set(LAYOUT_KEY, plan.layout)
    missing = _await_keys(store, {k: node_key(k) for k in range(1, plan.nnodes)}, wait)
    if missing:
        names = ", ".join(str(k) for k in missing)
        raise NodesError(
            f"node(s) {names} of --nnodes {plan.nnodes} did not arrive at {plan.master_addr}:{plan.master_port} "
            f"within {wait:g} s (--distributed-timeout-seconds): start `sonar serve MODEL --headless --nnodes "
            f"{plan.nnodes} --node-rank K --master-addr {plan.master_addr} --master-port {plan.master_port}` "
            "with the same model and parallel flags on each of them"
        )
    hosts = tuple(store.get(node_key(k)).decode() for k in range(1, plan.nnodes))
    log.info("nodes.arrived", nodes=plan.nnodes, hosts=list(hosts), rendezvous=f"{plan.master_addr}:{plan.master_port}")
    return store, msgspec.structs.replace(config, node_hosts=hosts)


def advertised_host(master_addr: str, master_port: int) -> str:
    """This machine's address on the route to the head (what the head will connect to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


@dataclass
class RankHost:
    """The actor host one rank of this node runs in, restarted whenever it ends."""

    rank: int
    """The rank whose actor this host runs (of its replica, with data-parallel replicas over nodes)."""
    address: str
    expect: str = ""
    """The name of the actor the head spawns here (``rank<N>`` unless given)."""
    replica: int = 0
    """With data-parallel replicas over nodes: the replica this rank belongs to."""
    proc: subprocess.Popen | None = None
    starts: deque = field(default_factory=deque)
    ended: deque = field(default_factory=lambda: deque(maxlen=ENDED_KEPT))
    """Pids of this host's runs that ended, newest last (reported to the head)."""

    def start(self, keys_dir: str | None, max_frame_bytes: int | None) -> None:
        # --expect: a step or JoinGroup from rank 0 that overtakes the head's Spawn waits for the rank
        cmd = [sys.executable, "-m", "sonar", "actor", "--listen", self.address, "--exit-with-actor"]
        cmd += ["--expect", self.expect or f"rank{self.rank}"]
        if keys_dir:
            cmd += ["--keys", keys_dir]
        if max_frame_bytes:
            cmd += ["--max-frame-bytes", str(max_frame_bytes)]
        self.starts.append(time.monotonic())
        while self.starts and self.starts[0] < time.monotonic() - HOST_PERIOD:
            self.starts.popleft()
        # its own session: a signal to the agent's terminal does not reach it before the agent's stop
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        log.info(
            "nodes.rank_host_started", rank=self.rank, replica=self.replica, address=self.address, pid=self.proc.pid
        )

    @property
    def crash_looping(self) -> bool:
        return len(self.starts) > HOST_RESTARTS

    def stop(self, grace: float = 5.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_headless(
    config: EngineConfig,
    keys_dir: str | None = None,
    max_frame_bytes: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """A headless node: keep its ranks' actor hosts up until the head is gone or `stop` is set
    (SIGTERM); the exit code."""
    stop = stop or threading.Event()
    require_keys()
    plan = NodePlan.of(config)
    wait = plan.wait_seconds(config.distributed_timeout_seconds)
    try:
        store = _store(plan, master=False, timeout=wait)
    except Exception as exc:  # torch's error says only that a connect timed out
        raise NodesError(
            f"no head answered at {plan.master_addr}:{plan.master_port} within {wait:g} s "
            f"(--master-addr, --master-port, --distributed-timeout-seconds): {type(exc).__name__}: {exc}"
        ) from None
    head_layout = store.get(LAYOUT_KEY).decode()
    if head_layout != plan.layout:
        raise NodesError(
            f"the head at {plan.master_addr}:{plan.master_port} runs {head_layout}, this node was started for "
            f"{plan.layout}: give every node the same --tensor-parallel-size, --pipeline-parallel-size and --nnodes"
        )
    address = advertised_host(plan.master_addr, plan.master_port)
    hosts = [RankHost(r, plan.host_address(r, address)) for r in plan.ranks_of(plan.node_rank)]
    for host in hosts:
        host.start(keys_dir, max_frame_bytes)
    store.set(node_key(plan.node_rank), address)
    log.info("nodes.joined", node=plan.node_rank, ranks=[h.rank for h in hosts], address=address)
    return _keep_hosts(hosts, store, f"{plan.master_addr}:{plan.master_port}", keys_dir, max_frame_bytes, stop)


def _keep_hosts(
    hosts: list[RankHost],
    store: object,
    rendezvous: str,
    keys_dir: str | None,
    max_frame_bytes: int | None,
    stop: threading.Event,
    report: Callable[[RankHost], None] | None = None,
    beat: Callable[[], None] | None = None,
) -> int:
    """Restart each host whenever it ends, until the head is gone or `stop` is set; the exit code.
    `report` tells the head about a host that ended (before its successor starts); `beat` tells it
    this node lives, at each check on the head. Stops the hosts on the way out."""
    code = 0
    next_poll = time.monotonic() + HEAD_POLL
    try:
        while not stop.is_set():
            for host in hosts:
                if host.proc is not None and host.proc.poll() is not None:
                    log.info("nodes.rank_host_ended", rank=host.rank, replica=host.replica, code=host.proc.returncode)
                    host.ended.append(host.proc.pid)
                    if report is not None:
                        report(host)
                    if host.crash_looping:
                        log.error("nodes.gave_up", rank=host.rank, restarts=len(host.starts), period=HOST_PERIOD)
                        return 1
                    host.start(keys_dir, max_frame_bytes)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + HEAD_POLL
                if not _head_alive(store):
                    log.info("nodes.head_gone", rendezvous=rendezvous)
                    break
                if beat is not None:
                    beat()
            stop.wait(0.1)
    finally:
        for host in hosts:
            host.stop()
    return code


def _head_alive(store: object) -> bool:
    try:
        return bool(store.check([HEAD_KEY]))
    except Exception:  # the connection to the head's store is gone
        return False


def open_data_parallel_head(config: EngineConfig) -> tuple[object, EngineConfig]:
    """The head of data-parallel replicas over several machines: open the rendezvous store at
    ``--data-parallel-address:--data-parallel-rpc-port`` and wait (blocking, up to
    ``--distributed-timeout-seconds``) until every replica past this machine's has a headless node.
    Returns the store (keep it: the nodes watch it to know the head lives) and `config` with the
    nodes (`EngineConfig.data_parallel_nodes`)."""
    require_keys("data-parallel replicas run")
    addr, port = config.data_parallel_address, config.data_parallel_rpc_port
    assert addr is not None and port is not None, "checked with the layout"
    wait = NODE_WAIT if config.distributed_timeout_seconds is None else config.distributed_timeout_seconds
    store = _open_store(addr, port, master=True, timeout=wait)
    store.set(HEAD_KEY, str(os.getpid()))
    store.set(DP_LAYOUT_KEY, data_parallel_layout(config))
    here = local_replicas(config)
    missing = _await_keys(store, {i: replica_key(i) for i in range(config.data_parallel_size) if i not in here}, wait)
    if missing:
        names = ", ".join(str(i) for i in missing)
        raise NodesError(
            f"no headless node came for data-parallel replica(s) {names} of --data-parallel-size "
            f"{config.data_parallel_size} at {addr}:{port} within {wait:g} s (--distributed-timeout-seconds): "
            f"start `sonar serve MODEL --headless --data-parallel-size {config.data_parallel_size} "
            f"--data-parallel-size-local L --data-parallel-start-rank S --data-parallel-address {addr} "
            f"--data-parallel-rpc-port {port}` with the same model and flags on the other machines"
        )
    nodes: set[tuple[str, int, int]] = set()
    for i in range(config.data_parallel_size):
        if i not in here:
            host, start, count = store.get(replica_key(i)).decode().split()
            nodes.add((host, int(start), int(count)))
    found = tuple(sorted(nodes, key=lambda n: n[1]))
    log.info("nodes.replicas_arrived", nodes=[list(n) for n in found], rendezvous=f"{addr}:{port}")
    return store, msgspec.structs.replace(config, data_parallel_nodes=found)


def run_data_parallel_headless(
    config: EngineConfig,
    keys_dir: str | None = None,
    max_frame_bytes: int | None = None,
    stop: threading.Event | None = None,
) -> int:
    """A headless node of data-parallel replicas: keep one actor host per replica of its own, where
    the head spawns the replica's worker, until the head is gone or `stop` is set; the exit code."""
    stop = stop or threading.Event()
    require_keys("data-parallel replicas run")
    addr, port = config.data_parallel_address, config.data_parallel_rpc_port
    assert addr is not None and port is not None, "checked with the layout"
    wait = NODE_WAIT if config.distributed_timeout_seconds is None else config.distributed_timeout_seconds
    try:
        store = _open_store(addr, port, master=False, timeout=wait)
        head_layout = store.get(DP_LAYOUT_KEY).decode()
    except Exception as exc:  # torch's error says only that a connect timed out
        raise NodesError(
            f"no head answered at {addr}:{port} within {wait:g} s (--data-parallel-address, "
            f"--data-parallel-rpc-port, --distributed-timeout-seconds): {type(exc).__name__}: {exc}"
        ) from None
    layout = data_parallel_layout(config)
    if head_layout != layout:
        raise NodesError(
            f"the head at {addr}:{port} runs {head_layout}, this node was started for {layout}: give every node "
            "the same --data-parallel-size, --tensor-parallel-size and --pipeline-parallel-size"
        )
    address = advertised_host(addr, port)
    mine = local_replicas(config)
    for i in mine:  # another node's replica: two nodes would answer for it
        if store.check([replica_key(i)]):
            other = store.get(replica_key(i)).decode().split()
            if other[0] != address or int(other[1]) != mine.start:
                raise NodesError(
                    f"data-parallel replica {i} already runs on the node at {other[0]} (replicas {other[1]} .. "
                    f"{int(other[1]) + int(other[2]) - 1}): give each headless node its own "
                    "--data-parallel-start-rank and --data-parallel-size-local"
                )
    world = config.world_size
    hosts = [
        RankHost(r, replica_host_address(address, port, i, world, r), "worker" if world == 1 else "", replica=i)
        for i in mine
        for r in range(world)
    ]
    for host in hosts:
        host.start(keys_dir, max_frame_bytes)
    for i in mine:
        store.set(replica_key(i), f"{address} {mine.start} {len(mine)}")
    log.info("nodes.replicas_joined", replicas=list(mine), ranks=world, address=address)

    def report(host: RankHost) -> None:
        # the head fails the rank that ran there at once, not after its ping deadline
        ended = [pid for h in hosts if h.replica == host.replica for pid in h.ended]
        try:
            store.set(host_ended_key(host.replica), " ".join(str(pid) for pid in ended))
        except Exception:  # the head is gone: the next look at its store ends this agent
            pass

    def beat() -> None:
        try:
            for i in mine:
                store.add(node_beat_key(i), 1)
        except Exception:  # the head is gone: the next look at its store ends this agent
            pass

    return _keep_hosts(hosts, store, f"{addr}:{port}", keys_dir, max_frame_bytes, stop, report, beat)


async def watch_replica_hosts(store: object, engine: "Supervisor", config: EngineConfig) -> None:
    """On the head of replicas over several machines, until cancelled: fail at once the worker of
    a headless node's replica whose actor host that node's agent reports ended (`host_ended_key`),
    or whose node stopped beating for `NODE_SILENT` seconds (`node_beat_key`: the node is gone,
    agent and all), so its supervisor restarts it now instead of after the worker's ping
    deadline. A report names the host's pid; a worker already running in the host's successor is
    left alone. A replica of several ranks has the rank that ran there failed (its one-for-all
    group restarts them all), or, its node silent, its rank 0."""
    here = local_replicas(config)
    remote = [i for i in range(config.data_parallel_size) if i not in here]
    replicas = Replicas(engine, config.data_parallel_size)
    seen = {i: "" for i in remote}
    beats = {i: (0, time.monotonic()) for i in remote}
    while True:
        await anyio.sleep(ENDED_POLL)
        reports, counts = await anyio.to_thread.run_sync(_node_news, store, remote)
        now = time.monotonic()
        for index in remote:
            try:
                workers = _rank_runners(replicas.engine(index))
            except (AssertionError, KeyError):  # the replica's engine (or its group) is restarting
                continue
            count = counts.get(index, 0)
            if count != beats[index][0]:
                beats[index] = (count, now)
            elif count and now - beats[index][1] > NODE_SILENT and workers[0].state == "running":
                log.warning("nodes.replica_node_silent", replica=index, seconds=NODE_SILENT)
                await workers[0].fail(f"its node has not been heard from for {NODE_SILENT:g} s")
                continue
            pids = reports.get(index, "")
            if pids == seen[index]:
                continue
            seen[index] = pids
            for worker in workers:
                if worker.pid is not None and str(worker.pid) in pids.split():
                    reason = f"its actor host (pid {worker.pid}) ended, as its node reported"
                    log.warning("nodes.replica_host_ended", replica=index, actor=worker.name, pid=worker.pid)
                    if worker.state == "stopping":  # its group is coming down already (a rank saw it go)
                        worker.host_ended(reason)
                    else:
                        await worker.fail(reason)
                    break  # one failed rank restarts the group


def _rank_runners(engine: "Supervisor") -> list[Any]:
    """The runners of a replica's worker: the worker alone, or its group's ranks, rank 0 first."""
    worker: Any = engine.child("worker")
    if worker.kind != "supervisor":
        return [worker]
    group = worker.child
    assert group is not None, "the group is running"
    return sorted(group.runners, key=lambda r: r.name != "rank0")


def _node_news(store: object, replicas: list[int]) -> tuple[dict[int, str], dict[int, int]]:
    """What the nodes left in the head's store: each replica's ended hosts and its node's beats."""
    ended, beats = {}, {}
    try:
        for index in replicas:
            key = host_ended_key(index)
            if store.check([key]):  # get() would wait for a key no node wrote yet
                ended[index] = store.get(key).decode()
            beats[index] = store.add(node_beat_key(index), 0)
    except Exception:  # the store is closing with the head
        pass
    return ended, beats
