"""Child processes placed by Ray (`RayBundle`): the ``ray`` executor backend's ranks.

Ray only places the processes; Sonar still runs and supervises them. Each child is the same
``python -m sonar actor`` host a `ChildProcess` placement starts, but its parent is a small Ray
actor (`RankKeeper`) scheduled into one bundle of a placement group that the supervisor's children
share (one bundle per rank: a GPU each on a cluster with GPUs, else a CPU). The host then talks to
its supervisor over Sonar's own transport, exactly as a child process does, so rendezvous, steps,
pings and restarts are unchanged.

The keeper is the host's parent: the host dies with it (``PR_SET_PDEATHSIG`` and its parent-pid
watch), so `ray.kill` of the keeper, a SIGKILL of either process or the loss of Ray's node all end
the run, which the supervisor sees as a crash of its child. The placement group lives while any of
its children runs and is removed with the last one (a group's restart makes a new one).

The hosts bind the supervisor's local (ipc) sockets, so every bundle must sit on this machine's Ray
node: a placement group Ray puts elsewhere is refused by name.
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

from sonar.actors.runners import EXTRA_RUNNERS, ChildProcessRunner
from sonar.actors.spec import OWN_GPU_ENV, ChildSpec, RayBundle
from sonar.errors import SonarError
from sonar.log import get_logger

if TYPE_CHECKING:
    from sonar.actors.supervisor import Supervisor

log = get_logger("sonar.actors")


_connecting = threading.Lock()


class RayPlacementError(SonarError, RuntimeError):
    """Ray could not place the processes: too few resources, or a node other than this one."""


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


@dataclass
class _Group:
    pg: PlacementGroup
    users: int = 0


_groups: dict[str, _Group] = {}


async def _acquire(key: str, size: int, timeout: float) -> PlacementGroup:
    """The placement group of `size` bundles that the children keyed `key` share, ready."""
    group = _groups.get(key)
    if group is None:
        bundles = [bundle_resources() for _ in range(size)]
        group = _groups[key] = _Group(placement_group(bundles, strategy="STRICT_PACK", name=f"sonar-{key}"))
        log.info("ray.placement_group", key=key, bundles=bundles)
    group.users += 1
    try:
        ready = group.pg.ready()
        with anyio.fail_after(timeout):
            await ready
    except TimeoutError:
        _release(key)
        raise RayPlacementError(
            f"Ray did not place {size} bundles of {group.pg.bundle_specs[0]} on one node within {timeout:.0f} s "
            f"(the cluster has {ray.available_resources()} free)"
        ) from None
    except BaseException:
        _release(key)
        raise
    here = ray.get_runtime_context().get_node_id()
    nodes = set(ray.util.placement_group_table(group.pg)["bundles_to_node_id"].values())
    if nodes != {here}:
        _release(key)
        raise RayPlacementError(
            f"Ray placed the ranks on node {sorted(nodes)}, not on this machine's ({here}): the ray backend "
            "runs its ranks on the Ray node of the process that serves (their control sockets are local)"
        )
    return group.pg


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
    """A child process (see `ChildProcessRunner`) whose parent is a Ray actor in a placement group."""

    def __init__(self, spec: ChildSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        assert isinstance(spec.placement, RayBundle)
        self.bundle: RayBundle = spec.placement

    @property
    def placement(self) -> str:
        return "ray"

    async def _open(self, args: list[str], env: dict[str, str]) -> Any:
        await anyio.to_thread.run_sync(connect)
        key = self.sup.uid  # a nested supervisor keeps its uid across restarts
        pg = await _acquire(key, self.bundle.bundles, self.bundle.place_timeout)
        resources = pg.bundle_specs[self.bundle.bundle]
        keeper = None
        try:
            keeper = RankKeeper.options(
                num_cpus=resources.get("CPU", 0),
                num_gpus=resources.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=self.bundle.bundle
                ),
            ).remote()
            pid = await keeper.start.remote(args, env)
        except BaseException:
            if keeper is not None:
                ray.kill(keeper)
            _release(key)
            raise
        log.info("ray.rank_placed", actor=self.name, bundle=self.bundle.bundle, pid=pid)
        return _KeptProcess(keeper, pid, key)


EXTRA_RUNNERS[RayBundle] = RayRunner
