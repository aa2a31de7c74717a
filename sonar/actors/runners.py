"""How a supervisor runs one child in each placement.

Each runner starts one run (incarnation) of its child at a time, reports how a run ended to its
supervisor (unless the supervisor stopped it on purpose), and knows how to stop it politely
within a deadline and how to force it down: cancel a task, or SIGTERM then SIGKILL a process.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

import anyio

from sonar.actors import allow, keys
from sonar.actors.actor import Actor, Incarnation, launch
from sonar.actors.host import HOST_NAME, HostEnding, HostMsg, Kill, Monitor, Spawn
from sonar.actors.messages import ActorError, ActorNotFound, AskTimeout, ExitInfo, Pong, RemoteError, Stop
from sonar.actors.node import MAX_FRAME_ENV, get_node
from sonar.actors.ref import ActorRef
from sonar.actors.spec import ChildProcess, ChildSpec, InProcess, Remote, SiblingRef, SupervisorSpec
from sonar.actors.tree import ActorInfo
from sonar.log import get_logger

if TYPE_CHECKING:
    from sonar.actors.supervisor import Supervisor

log = get_logger("sonar.actors")

KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL, and to wait after a cancel
HOST_ENDING = f"{HostEnding.__module__}.{HostEnding.__qualname__}"


class Runner:
    """Common state of a supervised child; subclasses implement `_start`, `_stop`, `_force`."""

    kind = "actor"

    def __init__(self, spec: Any, sup: "Supervisor") -> None:
        self.spec = spec
        self.sup = sup
        self.name: str = spec.name
        # Mailboxes are named per process: qualify the name by this supervisor, so two trees
        # (two engines, say) can each have a child called "worker".
        self.mailbox_name = f"{sup.uid}.{spec.name}"
        self.restarts = 0
        self.incarnation = 0
        self.state = "stopped"
        self.pid: int | None = None
        self.started_at: float | None = None
        self.last_exit: ExitInfo | None = None
        self.last_pong: Pong | None = None
        self.ref: ActorRef | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self.state in ("running", "starting")

    async def start(self) -> None:
        """Start a new run; returns when it is ready, raises when it fails to start."""
        self.incarnation += 1
        self._stopping = False
        self.state = "starting"
        self.last_pong = None
        try:
            await self._start(self.incarnation)
        except BaseException:
            self.state = "crashed"
            raise
        self.state = "running"
        self.started_at = time.time()
        log.info("actor.ready", actor=self.name, placement=self.placement, pid=self.pid, incarnation=self.incarnation)

    async def stop(self) -> None:
        """Stop on purpose: politely, then by force after the shutdown deadline."""
        if not self.running:
            return
        self._stopping = True
        self.state = "stopping"
        await self._stop()
        self.state = "stopped"
        log.info("actor.stopped", actor=self.name)

    async def fail(self, reason: str) -> None:
        """Force the current run down and report it as failed (a hung child)."""
        if self.state != "running":
            return
        await self._force(reason)

    def exited(self, incarnation: int, info: ExitInfo) -> None:
        """Called by the run's watcher when the run ended."""
        if incarnation != self.incarnation:
            return
        self.last_exit = info
        self.pid = self.pid if self.kind == "supervisor" else None
        if self.kind == "actor":
            get_node().fail_asks(
                self.mailbox_name, f"actor {self.name!r} ended ({info.reason}) before it answered", self.ask_peer
            )
        if self._stopping:
            return
        self.state = "stopped" if info.normal else "crashed"
        self.sup.child_exited(self, incarnation, info)

    @property
    def placement(self) -> str:
        return "inprocess"

    @property
    def ask_peer(self) -> str | None:
        """Where asks to this child go, when its mailbox name alone does not tell (None)."""
        return None

    def mailbox_depth(self) -> int | None:
        """Messages waiting in the mailbox, as the last answered ping reported it."""
        return self.last_pong.mailbox_depth if self.last_pong else None

    def info(self) -> ActorInfo:
        depth = self.mailbox_depth()
        return ActorInfo(
            name=self.name,
            kind=self.kind,
            placement=self.placement,
            pid=self.pid,
            state=self.state,
            restarts=self.restarts,
            mailbox_depth=depth,
            started_at=self.started_at,
            last_exit=(self.last_exit.reason if self.last_exit else None),
        )

    async def _start(self, incarnation: int) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    async def _force(self, reason: str) -> None:
        raise NotImplementedError


def _kwargs(runner: Runner) -> dict[str, Any]:
    """The child's constructor arguments, with each `SiblingRef` (alone or in a list) replaced by
    that sibling's ref (the one a later sibling will have, see `SiblingRef`)."""
    out = {}
    for key, value in runner.spec.kwargs.items():
        if isinstance(value, SiblingRef):
            value = _sibling_ref(runner, key, value)
        elif isinstance(value, list) and any(isinstance(v, SiblingRef) for v in value):
            value = [_sibling_ref(runner, key, v) if isinstance(v, SiblingRef) else v for v in value]
        out[key] = value
    return out


def _sibling_ref(runner: Runner, key: str, sibling_ref: SiblingRef) -> ActorRef:
    """The ref `sibling_ref` names, from `runner`'s supervisor along its path."""
    sup: Any = runner.sup
    *path, name = sibling_ref.name.split("/")
    for part in path:
        if part == "..":
            sup = sup.parent
        else:
            nested = sup.child(part)
            sup = getattr(nested, "child", None)
        if sup is None:
            raise RuntimeError(f"{runner.name}: {key!r} names {sibling_ref.name!r}, which does not run yet")
    sibling = sup.child(name)
    planned = getattr(sibling, "planned_ref", None)
    value = sibling.ref if sibling.ref is not None or planned is None else planned()
    if value is None:
        raise RuntimeError(f"{runner.name}: sibling {key!r} has no reference yet (start it first)")
    return value


def _actor_class(spec: ChildSpec) -> type:
    """The child's actor class; this process's own spec names it, so it goes on the allow-list
    (refs of its protocol can then come back from other processes)."""
    path = allow.allow_actor(spec.actor)
    return allow.load_actor(path, Actor) if isinstance(spec.actor, str) else spec.actor


def _protocol(spec: ChildSpec) -> Any:
    """The child's protocol: the spec's own (its module left unimported), else its class's."""
    if spec.protocol is None:
        return _actor_class(spec).protocol
    allow.allow_actor(spec.actor)
    try:
        allow.protocol_path(spec.protocol)
    except TypeError:  # not a module-level name: no ref of it can cross processes anyway
        pass
    return spec.protocol


def _target(spec: ChildSpec) -> str:
    return spec.actor if isinstance(spec.actor, str) else allow.import_path(spec.actor)


def _module(spec: ChildSpec) -> str:
    return _target(spec).partition(":")[0]


class InProcessRunner(Runner):
    """The child is a task in the supervisor's task group."""

    def __init__(self, spec: ChildSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        self.ref = ActorRef(self.mailbox_name, _protocol(spec))
        self.inc: Incarnation | None = None

    @functools.cached_property
    def cls(self) -> type:
        return _actor_class(self.spec)

    def planned_ref(self) -> ActorRef:
        return self.ref

    def mailbox_depth(self) -> int | None:
        """The live depth: the mailbox is in this process, no ping needed."""
        if self.inc is None or self.inc.done.is_set():
            return None
        return self.inc.mailbox.depth()

    async def _start(self, incarnation: int) -> None:
        self.pid = os.getpid()
        self.inc = await launch(
            self.sup.tg, self.cls(**_kwargs(self)), self.mailbox_name, self.spec.mailbox_size, self.name
        )
        self.sup.tg.start_soon(self._watch, incarnation, self.inc)

    async def _watch(self, incarnation: int, inc: Incarnation) -> None:
        await inc.done.wait()
        assert inc.exit is not None
        self.exited(incarnation, inc.exit)

    async def _stop(self) -> None:
        inc = self.inc
        if inc is None or inc.done.is_set():
            return
        with anyio.move_on_after(self.spec.shutdown):
            try:
                await inc.mailbox.send.send(Stop())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
            await inc.done.wait()
        if not inc.done.is_set():
            log.warning("actor.kill", actor=self.name, reason=f"no stop within {self.spec.shutdown} s")
            inc.kill("killed after shutdown deadline")
            with anyio.move_on_after(KILL_GRACE):
                await inc.done.wait()
            if not inc.done.is_set():
                log.error("actor.unstoppable", actor=self.name, reason="blocked outside an await")

    async def _force(self, reason: str) -> None:
        if self.inc is not None:
            self.inc.kill(reason)


class _HostedRunner(Runner):
    """Shared by child-process and remote placements: the child runs inside an actor host."""

    host: ActorRef
    address: str

    def planned_address(self) -> str:
        return self.address

    def planned_ref(self) -> ActorRef:
        """The reference this child has once it runs, from its spec alone."""
        return ActorRef(self.mailbox_name, _protocol(self.spec), self.planned_address())

    async def _spawn(self, incarnation: int, timeout: float) -> None:
        protocol = _protocol(self.spec)
        spawned = await self.host.ask(
            Spawn(
                name=self.mailbox_name,
                target=_target(self.spec),
                kwargs=_kwargs(self),
                mailbox_size=self.spec.mailbox_size,
                display=self.name,
            ),
            timeout=timeout,
        )
        self.pid = spawned.pid
        self.ref = ActorRef(self.mailbox_name, protocol, self.address)

    async def _monitor(self, incarnation: int, out: list[ExitInfo]) -> None:
        """Wait for the host to tell how this run ended."""
        try:
            out.append(await self.host.ask(Monitor(name=self.mailbox_name)))
        except Exception as exc:  # the host went away: the process watcher reports it
            out.append(ExitInfo(False, "host unreachable", RemoteError.from_exception(exc)))


class ChildProcessRunner(_HostedRunner):
    """The child runs in a spawned `python -m sonar actor --parent ...` process."""

    def __init__(self, spec: ChildSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        self.proc: anyio.abc.Process | None = None
        self._exit_event: anyio.Event | None = None
        self._force_reason: str | None = None

    @property
    def placement(self) -> str:
        return "process"

    def planned_address(self) -> str:
        return get_node().ipc_address(f"child-{self.mailbox_name}")

    async def _start(self, incarnation: int) -> None:
        node = get_node()
        parent = node.ensure_bound()
        self.address = self.planned_address()
        self.host = ActorRef(HOST_NAME, HostMsg, self.address)
        hello_id = secrets.token_hex(8)
        hello = node.expect_hello(hello_id)
        env = self._host_env()
        # Secrets travel in the environment (readable by this user only), never on the command line.
        env.update(node.credentials.to_env())
        args = [
            "--parent",
            parent,
            "--hello",
            hello_id,
            "--bind",
            self.address,
            "--preload",
            _module(self.spec),
            "--expect",
            self.mailbox_name,
        ]
        await self._run_host(incarnation, args, env, hello)

    def _host_env(self) -> dict[str, str]:
        """The host's environment, less any credentials: this process's, with its import path, the
        child's actor class allowed and the frame cap."""
        env = {k: v for k, v in os.environ.items() if k not in (keys.ENV_DIR, *keys.INLINE)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env[allow.ENV] = ",".join(p for p in (os.environ.get(allow.ENV, ""), _target(self.spec)) if p)
        env[MAX_FRAME_ENV] = str(get_node().max_frame_bytes)
        return env

    async def _run_host(
        self, incarnation: int, args: list[str], env: dict[str, str], hello: "asyncio.Future | None"
    ) -> None:
        """Start the host (`_open`), wait for its `hello` (None: a host that says none, reached at
        `self.address` once it listens), spawn the child there and watch the run."""
        proc = await self._open(args, env)
        self.proc = proc
        self.pid = proc.pid
        self._force_reason = None
        timeout = self.spec.placement.start_timeout
        try:
            with anyio.fail_after(timeout):
                async with anyio.create_task_group() as tg:

                    async def _died() -> None:
                        await proc.wait()
                        raise RuntimeError(f"actor process exited with code {proc.returncode} before it was ready")

                    tg.start_soon(_died)
                    if hello is not None:
                        await hello
                    await self._spawn(incarnation, timeout)
                    tg.cancel_scope.cancel()
        except BaseException as exc:
            await self._kill_process(proc)
            raise _unwrap(exc) from None
        self._exit_event = anyio.Event()
        self.sup.tg.start_soon(self._watch, incarnation, proc, self._exit_event)

    async def _open(self, args: list[str], env: dict[str, str]) -> Any:
        """Start the actor host with `args` (`python -m sonar actor ARGS`, less ``--parent-pid``,
        which is the pid of whoever starts it) as this process's child."""
        cmd = [sys.executable, "-m", "sonar", "actor", "--parent-pid", str(os.getpid()), *args]
        return await anyio.open_process(
            cmd, stdin=subprocess.DEVNULL, stdout=None, stderr=None, env=env, start_new_session=True
        )

    async def _watch(self, incarnation: int, proc: anyio.abc.Process, exited: anyio.Event) -> None:
        infos: list[ExitInfo] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._monitor, incarnation, infos)
            code = await proc.wait()
            if self._force_reason is None:
                with anyio.move_on_after(0.2):  # the host's last words, if they are on the way
                    while not infos:
                        await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        exited.set()
        reported = infos[0] if infos and infos[0].reason != "host unreachable" else None
        if self._force_reason is not None:
            info = ExitInfo(False, self._force_reason)
        elif reported is not None:
            info = reported
        elif code == 0:
            info = ExitInfo(True, "normal")
        elif code < 0:
            info = ExitInfo(False, f"killed by signal {signal.Signals(-code).name}")
        else:
            info = ExitInfo(False, f"process exited with code {code}")
        self.exited(incarnation, info)

    async def _stop(self) -> None:
        proc, exited = self.proc, self._exit_event
        if proc is None or exited is None or exited.is_set():
            return
        with anyio.move_on_after(self.spec.shutdown):
            try:
                await self.ref.send(Stop())  # type: ignore[union-attr]
            except ActorNotFound:
                pass
            await exited.wait()
        if not exited.is_set():
            log.warning("actor.kill", actor=self.name, pid=proc.pid, reason=f"no stop within {self.spec.shutdown} s")
            await self._kill_process(proc)
            await exited.wait()

    async def _force(self, reason: str) -> None:
        self._force_reason = reason
        if self.proc is not None and self.proc.returncode is None:
            log.warning("actor.kill", actor=self.name, pid=self.proc.pid, reason=reason)
            _signal(self.proc, signal.SIGKILL)

    async def _kill_process(self, proc: anyio.abc.Process) -> None:
        """SIGTERM, then SIGKILL after a grace period; returns when the process is gone."""
        if proc.returncode is not None:
            return
        _signal(proc, signal.SIGTERM)
        with anyio.move_on_after(KILL_GRACE):
            await proc.wait()
            return
        log.warning("actor.sigkill", actor=self.name, pid=proc.pid)
        _signal(proc, signal.SIGKILL)
        await proc.wait()


class RemoteRunner(_HostedRunner):
    """The child runs in an actor host that listens at a fixed address (possibly another machine)."""

    def __init__(self, spec: ChildSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        # A remote host outlives supervisors: a restarted supervisor's child replaces the
        # instance its predecessor left there, so the name is not qualified.
        self.mailbox_name = spec.name
        placement = spec.placement
        assert isinstance(placement, Remote)
        self.address = placement.address
        self.host = ActorRef(HOST_NAME, HostMsg, self.address)
        self._exit_event: anyio.Event | None = None
        self._force_reason: str | None = None

    @property
    def placement(self) -> str:
        return self.address

    @property
    def ask_peer(self) -> str | None:
        return self.address  # hosts elsewhere may each run an actor of the same (unqualified) name

    async def _start(self, incarnation: int) -> None:
        self._force_reason = None
        if get_node().credentials.ephemeral:
            raise RuntimeError(
                f"placement {self.address}: an actor host elsewhere needs the deployment's keys here too "
                f"(python -m sonar actor keygen DIR; then {keys.ENV_DIR}=DIR, or sonar serve --actor-keys DIR)"
            )
        deadline = time.monotonic() + self.spec.placement.start_timeout
        try:
            while True:
                try:
                    await self._spawn(incarnation, self.spec.placement.start_timeout)
                    break
                except ActorError as exc:
                    # a one-actor host (--exit-with-actor) still ending its last run: ask its successor
                    if exc.error.type != HOST_ENDING or time.monotonic() > deadline:
                        raise
                    await anyio.sleep(0.2)
        except AskTimeout:
            raise RuntimeError(
                f"no actor host answered at {self.address} (is it running with this "
                "deployment's keys, and this machine's client key authorized there?)"
            ) from None
        self._exit_event = anyio.Event()
        self.sup.tg.start_soon(self._watch, incarnation, self._exit_event)

    async def _watch(self, incarnation: int, exited: anyio.Event) -> None:
        infos: list[ExitInfo] = []
        await self._monitor(incarnation, infos)
        exited.set()
        info = ExitInfo(False, self._force_reason) if self._force_reason else infos[0]
        self.exited(incarnation, info)

    async def _stop(self) -> None:
        exited = self._exit_event
        if exited is None or exited.is_set():
            return
        with anyio.move_on_after(self.spec.shutdown):
            await self.ref.send(Stop())  # type: ignore[union-attr]
            await exited.wait()
        if not exited.is_set():
            log.warning("actor.kill", actor=self.name, address=self.address)
            with anyio.move_on_after(KILL_GRACE + 1):
                await self.host.ask(Kill(name=self.mailbox_name), timeout=KILL_GRACE + 1)
                await exited.wait()

    def host_ended(self, reason: str) -> None:
        """The host of the run being stopped is known to be gone (its node's agent said so): the
        stop ends now instead of waiting out its deadline for an answer that cannot come. (A run
        still running is failed instead: `fail`.)"""
        exited = self._exit_event
        if self._stopping and exited is not None and not exited.is_set():
            self._force_reason = reason
            exited.set()
            self.exited(self.incarnation, ExitInfo(False, reason))

    async def _force(self, reason: str) -> None:
        self._force_reason = reason
        exited = self._exit_event
        try:
            await self.host.ask(Kill(name=self.mailbox_name), timeout=KILL_GRACE)
        except (AskTimeout, ActorNotFound):
            log.error("actor.unreachable", actor=self.name, address=self.address)
        else:
            # the host's monitor reports the run it killed; a fresh host at the address (the
            # one that ran it died: a one-actor host restarted by its node) never heard of it
            with anyio.move_on_after(KILL_GRACE):
                if exited is not None:
                    await exited.wait()
        if exited is not None and not exited.is_set():
            exited.set()
            self.exited(self.incarnation, ExitInfo(False, reason))


class SupervisorRunner(Runner):
    """A nested supervisor, run as a child of its parent supervisor."""

    kind = "supervisor"

    def __init__(self, spec: SupervisorSpec, sup: "Supervisor") -> None:
        super().__init__(spec, sup)
        self.child: "Supervisor | None" = None
        self.child_uid = secrets.token_hex(3)
        """The nested supervisor's uid, the same in every run (its children's refs outlive a restart)."""

    async def _start(self, incarnation: int) -> None:
        self.pid = os.getpid()
        self.child = type(self.sup)(self.spec, parent=self.sup, uid=self.child_uid)
        done = anyio.Event()
        ready = anyio.Event()
        box: list[BaseException] = []
        self.sup.tg.start_soon(self._run, incarnation, self.child, ready, done, box)
        await ready.wait()
        if box and not self.child.ready:
            raise box[0]

    async def _run(
        self, incarnation: int, child: "Supervisor", ready: anyio.Event, done: anyio.Event, box: list[BaseException]
    ) -> None:
        try:
            await child.run(on_ready=ready.set)
            info = ExitInfo(True, "normal")
        except Exception as exc:
            box.append(exc)
            info = ExitInfo(False, "gave up" if child.ready else "failed to start", RemoteError.from_exception(exc))
        finally:
            ready.set()
            done.set()
        if child.ready:
            self.exited(incarnation, info)

    async def _stop(self) -> None:
        if self.child is not None:
            await self.child.shutdown()

    async def _force(self, reason: str) -> None:
        await self._stop()

    def info(self) -> ActorInfo:
        info = super().info()
        if self.child is not None and self.running:
            info.children = [r.info() for r in self.child.runners]
        return info


EXTRA_RUNNERS: dict[type, Callable[[ChildSpec, "Supervisor"], Runner]] = {}
"""Runners of the placements an optional module adds when it is imported (`RayBundle`:
`sonar.actors.ray_runner`, which needs the ``ray`` extra)."""


def make_runner(spec: "ChildSpec | SupervisorSpec", sup: "Supervisor") -> Runner:
    if isinstance(spec, SupervisorSpec):
        return SupervisorRunner(spec, sup)
    if isinstance(spec.placement, InProcess):
        return InProcessRunner(spec, sup)
    if isinstance(spec.placement, ChildProcess):
        return ChildProcessRunner(spec, sup)
    if isinstance(spec.placement, Remote):
        return RemoteRunner(spec, sup)
    extra = EXTRA_RUNNERS.get(type(spec.placement))
    if extra is not None:
        return extra(spec, sup)
    raise TypeError(f"unknown placement {spec.placement!r}")


def _signal(proc: anyio.abc.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
