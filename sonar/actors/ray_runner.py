"""Child processes placed by Ray (`RayBundle`): the ``ray`` executor backend's ranks.

Ray only places the processes; Sonar still runs and supervises them. Each child is the same
``python -m sonar actor`` host a `ChildProcess` placement starts, but its parent is a small Ray
actor (`RankKeeper`) scheduled into one bundle of a placement group that the supervisor's children
share (one bundle per rank: a GPU each on a cluster with GPUs, else a CPU). The host then talks to
its supervisor over Sonar's own transport, so rendezvous, steps, pings and restarts are unchanged.

The group is placed ``STRICT_PACK`` when the serving process's Ray node can hold all of it, else
``PACK`` (as few nodes as Ray can). Ranks take the bundles on the serving process's node first, so
rank 0 (which talks to the scheduler over local sockets) runs there; a group with no bundle there
is refused by name, unless its placement says rank 0 may run `anywhere` (a data-parallel replica
under ``--data-parallel-backend ray``: its rank 0 on another node reaches the scheduler over tcp,
as a headless node's replica does). A rank on this node is a child process as any other (private
ipc sockets). A rank Ray puts on another node listens instead at ``tcp://<that node's Ray address>:
<RayBundle.port>`` (``--master-port + rank``, as a headless node's ranks do), CURVE with the
deployment's keys (`--keys DIR`: the directory must be at the same path on every node; no secret
travels through Ray), and the supervisor spawns the rank there as on a remote host. A spread group
meets at a rendezvous on rank 0's Ray node address (`RENDEZVOUS_HOST_ENV`), not on loopback.

The keeper is the host's parent: the host dies with it (``PR_SET_PDEATHSIG`` and its parent-pid
watch), so `ray.kill` of the keeper, a SIGKILL of either process or the loss of Ray's node all end
the run, which the supervisor sees as a crash of its child. The placement group lives while any of
its children runs and is removed with the last one (a group's restart makes a new one, which Ray
may place differently: each rank's address is read from the group it runs in).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sonar.actors import keys
from sonar.actors.host import HOST_NAME, HostMsg
from sonar.actors.node import get_node
from sonar.actors.ref import ActorRef
from sonar.actors.runners import EXTRA_RUNNERS, ChildProcessRunner
from sonar.actors.spec import OWN_GPU_ENV, RENDEZVOUS_HOST_ENV, ChildSpec, RayBundle
from sonar.errors import SonarError
from sonar.log import get_logger

if TYPE_CHECKING:
    from sonar.actors.supervisor import Supervisor

log = get_logger("sonar.actors")


_connecting = threading.Lock()


class RayPlacementError(SonarError, RuntimeError):
    """Ray could not place the processes (too few resources), or placed them where they cannot run."""


def connect() -> None:
    """Join the Ray cluster this process should use, unless it already has: ``RAY_ADDRESS``, else
    the cluster started on this machine (``ray start``), else a local runtime of its own (what
    `ray.init` does by default, as vLLM does). The ranks start together, each from a thread."""
    with _connecting:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True)
            log.info("ray.connected", resources=ray.cluster_resources())


def bundle_resources() -> dict[str, float]:
    """One rank's bundle: a GPU on a cluster that has them (unless ``SONAR_DEVICE=cpu``), else a CPU."""
    forced = os.environ.get("SONAR_DEVICE", "").strip().lower()
    if forced != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1:
        return {"CPU": 1, "GPU": 1}
    return {"CPU": 1}


@ray.remote
class RankKeeper:
    """The Ray actor that holds one bundle and is the parent of one actor-host process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    async def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start ``python -m sonar actor ARGS`` as this actor's child; its pid."""
        env = dict(env)
        gpus = ray.get_gpu_ids()
        if gpus:  # Ray chose this rank's GPU: the host sees it alone
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus)))
            env[OWN_GPU_ENV] = "1"
        cmd = [sys.executable, "-m", "sonar", "actor", "--parent-pid", str(os.getpid()), *args]
        # Started from the actor's event loop thread, which lives as long as the actor: the
        # host's PR_SET_PDEATHSIG follows that thread.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return self.proc.pid

    async def wait(self) -> int:
        """The host's exit code, once it has exited."""
        assert self.proc is not None
        while self.proc.poll() is None:
            await asyncio.sleep(0.05)
        return self.proc.returncode

    async def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    async def pid(self) -> int:
        """The pid of this actor's own process (the host's parent)."""
        return os.getpid()


@dataclass(frozen=True)
class _Slot:
    """Where one rank runs: its bundle, and its node's address when that is not this node."""

    bundle: int
    remote: str | None = None


@dataclass
class _Group:
    pg: PlacementGroup
    strategy: str
    users: int = 0
    slots: list[_Slot] | None = None
    """Per rank, once Ray has placed the group."""
    here: str = ""
    """The serving process's Ray node address."""
    meet: str = ""
    """Rank 0's Ray node address, where the group's rendezvous listens."""

    @property
    def spread(self) -> bool:
        return self.slots is not None and any(s.remote is not None for s in self.slots)


_groups: dict[str, _Group] = {}


def assign_bundles(bundle_nodes: dict[int, str], here: str) -> list[int]:
    """Each rank's bundle: the bundles on node `here` first (rank 0 among them), then the others,
    each part in bundle order (the ranks of one node stay neighbours)."""
    return sorted(bundle_nodes, key=lambda b: (bundle_nodes[b] != here, b))


def _fits_here(size: int, bundle: dict[str, float]) -> bool:
    """Whether this process's Ray node has, in all, the resources of `size` bundles."""
    here = ray.get_runtime_context().get_node_id()
    total = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == here), {})
    return all(total.get(name, 0) >= size * amount for name, amount in bundle.items())


async def _acquire(key: str, bundle: RayBundle) -> _Group:
    """The placed group of the children keyed `key` (bundle.bundles bundles), ready."""
    size = bundle.bundles
    group = _groups.get(key)
    if group is None:
        bundles = [bundle_resources() for _ in range(size)]
        # a group that may not spread (`port` None) waits for one node, as one that fits here does
        strategy = "STRICT_PACK" if bundle.port is None or _fits_here(size, bundles[0]) else "PACK"
        group = _groups[key] = _Group(placement_group(bundles, strategy=strategy, name=f"sonar-{key}"), strategy)
        log.info("ray.placement_group", key=key, bundles=bundles, strategy=strategy)
    group.users += 1
    try:
        ready = group.pg.ready()
        with anyio.fail_after(bundle.place_timeout):
            await ready
        if group.slots is None:
            _place(group, size, may_spread=bundle.port is not None, anywhere=bundle.anywhere)
    except TimeoutError:
        _release(key)
        where = "on one node" if group.strategy == "STRICT_PACK" else "on the cluster"
        raise RayPlacementError(
            f"Ray did not place {size} bundles of {group.pg.bundle_specs[0]} {where} within "
            f"{bundle.place_timeout:.0f} s (the cluster has {ray.available_resources()} free)"
        ) from None
    except BaseException:
        _release(key)
        raise
    return group


def _place(group: _Group, size: int, may_spread: bool, anywhere: bool) -> None:
    """Give each rank its bundle, or refuse a placement Sonar cannot run (`RayPlacementError`):
    rank 0 off the serving process's node unless `anywhere`, ranks off it unless `may_spread`."""
    here = ray.get_runtime_context().get_node_id()
    table = ray.util.placement_group_table(group.pg)["bundles_to_node_id"]
    nodes = {int(b): node for b, node in table.items()}
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    order = assign_bundles(nodes, here)
    elsewhere = sorted({addresses.get(n, n) for n in nodes.values() if n != here})
    if nodes[order[0]] != here and not anywhere:
        raise RayPlacementError(
            f"Ray placed all {size} ranks on other nodes ({', '.join(elsewhere)}), none on the serving process's "
            f"({addresses.get(here, here)}): rank 0 runs there (it talks to the scheduler over local sockets); "
            f"free a bundle's resources ({group.pg.bundle_specs[0]}) on it"
        )
    if elsewhere and not may_spread:
        raise RayPlacementError(
            f"Ray placed ranks on other nodes ({', '.join(elsewhere)}): pipeline-parallel stages run on the "
            "serving process's Ray node only (the last stage answers rank 0 over a local socket); spread "
            "over nodes with --tensor-parallel-size only"
        )
    group.here = addresses.get(here, "")
    group.meet = addresses.get(nodes[order[0]], "")
    group.slots = [_Slot(b, None if nodes[b] == here else addresses[nodes[b]]) for b in order]


def _slot(key: str, rank: int) -> _Slot | None:
    group = _groups.get(key)
    return None if group is None or group.slots is None else group.slots[rank]


def _release(key: str) -> None:
    group = _groups.get(key)
    if group is None:
        return
    group.users -= 1
    if group.users <= 0:
        del _groups[key]
        remove_placement_group(group.pg)
        log.info("ray.placement_group_removed", key=key)


class _KeptProcess:
    """A host kept by a `RankKeeper`, with the parts of `anyio.abc.Process` a runner uses."""

    def __init__(self, keeper: Any, pid: int, key: str) -> None:
        self.keeper = keeper
        self.pid = pid
        self.key = key
        self.returncode: int | None = None
        self._released = False

    async def wait(self) -> int:
        if self.returncode is None:
            try:
                code = await self.keeper.wait.remote()
            except ray.exceptions.RayActorError:  # the keeper died, its host with it
                code = -signal.SIGKILL
            self.returncode = code if self.returncode is None else self.returncode
            self.release()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if sig == signal.SIGKILL:
            ray.kill(self.keeper)  # its host follows it down (PR_SET_PDEATHSIG)
        else:
            self.keeper.signal.remote(sig)

    def release(self) -> None:
        """The run is over: the keeper goes, and the placement group with the group's last run."""
        if not self._released:
            self._released = True
            ray.kill(self.keeper)
            _release(self.key)


class RayRunner(ChildProcessRunner):
    """A child process (see `ChildProcessRunner`) whose parent is a Ray actor in a placement group;
    on another node than this one, a host listening at that node's address."""

    def __init__(self, spec: ChildSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        assert isinstance(spec.placement, RayBundle)
        self.bundle: RayBundle = spec.placement
        self._kept = False

    @property
    def placement(self) -> str:
        return "ray"

    @property
    def key(self) -> str:
        return self.sup.uid  # a nested supervisor keeps its uid across restarts

    def planned_address(self) -> str:
        slot = _slot(self.key, self.bundle.bundle)
        if slot is None or slot.remote is None:
            return super().planned_address()
        return f"tcp://{slot.remote}:{self.bundle.port}"

    async def _start(self, incarnation: int) -> None:
        await anyio.to_thread.run_sync(connect)
        # a restart may put this rank on another node: its siblings take the ref of this run's place
        self.ref = None
        self._kept = False
        group = await _acquire(self.key, self.bundle)
        try:
            assert group.slots is not None
            if group.slots[self.bundle.bundle].remote is None:
                await super()._start(incarnation)
            else:
                await self._start_remote(incarnation)
        except BaseException:
            if not self._kept:  # no keeper holds the group's share of this run to release it
                _release(self.key)
            raise

    async def _start_remote(self, incarnation: int) -> None:
        """Start this rank's host on another node, listening at its planned address, and spawn
        the rank there."""
        node = get_node()
        creds = node.credentials
        if creds.ephemeral or not os.path.isdir(creds.source):
            raise RayPlacementError(
                f"Ray placed rank {self.bundle.bundle} on another node ({self.planned_address()}): "
                "a rank there is reached over tcp, authenticated with the deployment's keys, which it reads "
                f"from the same directory: python -m sonar actor keygen DIR, copied to every Ray node; then "
                f"--actor-keys DIR or {keys.ENV_DIR}=DIR"
            )
        self.address = self.planned_address()
        self.host = ActorRef(HOST_NAME, HostMsg, self.address)
        args = ["--listen", self.address, "--exit-with-actor", "--expect", self.mailbox_name]
        args += ["--keys", creds.source, "--max-frame-bytes", str(node.max_frame_bytes)]
        await self._run_host(incarnation, args, self._host_env(), None)

    def _host_env(self) -> dict[str, str]:
        env = super()._host_env()
        group = _groups.get(self.key)
        if group is not None and group.spread:
            env[RENDEZVOUS_HOST_ENV] = group.meet
        return env

    async def _open(self, args: list[str], env: dict[str, str]) -> Any:
        group = _groups[self.key]
        slot = _slot(self.key, self.bundle.bundle)
        assert slot is not None
        resources = group.pg.bundle_specs[slot.bundle]
        keeper = None
        try:
            keeper = RankKeeper.options(
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.pg, placement_group_bundle_index=slot.bundle
                ),
            ).remote()
            pid = await keeper.start.remote(args, env)
        except BaseException:
            if keeper is not None:
                ray.kill(keeper)
            raise
        self._kept = True
        log.info("ray.rank_placed", actor=self.name, bundle=slot.bundle, node=slot.remote or group.here, pid=pid)
        return _KeptProcess(keeper, pid, self.key)


EXTRA_RUNNERS[RayBundle] = RayRunner
