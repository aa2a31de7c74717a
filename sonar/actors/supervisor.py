"""Supervisors with Erlang/OTP semantics: ordered start, reverse stop, restart strategies,
restart intensity, liveness pings, and a root that turns giving up into a non-zero exit."""

from __future__ import annotations

import secrets
import signal
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import anyio
import msgspec

from sonar.actors.actor import exception_leaves
from sonar.actors.messages import ActorError, ActorNotFound, AskTimeout, ExitInfo, Ping
from sonar.actors.node import get_node
from sonar.actors.runners import Runner, make_runner
from sonar.actors.spec import SupervisorSpec
from sonar.actors.tree import ActorInfo
from sonar.errors import SonarError
from sonar.log import get_logger

log = get_logger("sonar.actors")


class SupervisorGaveUp(SonarError, RuntimeError):
    """A supervisor saw more restarts than its intensity allows; it stopped all its children."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"supervisor {name!r} gave up: {reason}")
        self.supervisor = name
        self.reason = reason


class Event(msgspec.Struct, frozen=True):
    """One lifecycle step a supervisor took, kept for introspection and tests."""

    time: float
    kind: str  # start | stop | crash | exit | restart | hung | give_up
    child: str
    detail: str = ""


class Supervisor:
    def __init__(self, spec: SupervisorSpec, parent: "Supervisor | None" = None, uid: str | None = None) -> None:
        """`uid` qualifies the children's mailbox names: a nested supervisor keeps its parent's
        choice across restarts, so references to its children stay valid (random by default)."""
        self.spec = spec
        self.name = spec.name
        self.uid = uid or secrets.token_hex(3)
        self.parent = parent
        self.runners: list[Runner] = []
        self.ready = False
        self.events: deque[Event] = deque(maxlen=1000)
        self.listeners: list[Callable[[Event], None]] = []
        """Called (synchronously, in the supervisor's task) with every new event."""
        self._restarts: deque[float] = deque()
        self._starting_seconds = 0.0
        """Time spent starting children since this supervisor started; the restart-intensity
        clock leaves it out (see `_clock`)."""
        self._exits_send, self._exits = anyio.create_memory_object_stream[tuple](max_buffer_size=1000)
        self._shutdown = anyio.Event()
        self._supervising = anyio.CancelScope()
        self._done = anyio.Event()
        self.tg: anyio.abc.TaskGroup

    # -- public -----------------------------------------------------------------------------
    async def run(self, on_ready: Callable[[], None] | None = None) -> None:
        """Start the children in order, supervise them until `shutdown()`, stop them in reverse.

        Raises `SupervisorGaveUp` when restart intensity is exceeded, or the first child's start
        error when the initial start fails (the children already started are stopped first).
        """
        try:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                self.runners = [make_runner(c, self) for c in self.spec.children]
                try:
                    await self._start_group(self.runners)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self._stop_all([r for r in self.runners if r.running])
                    raise
                for runner in self.runners:
                    interval = getattr(runner.spec, "ping_interval", None)
                    if interval and runner.kind == "actor":
                        tg.start_soon(self._ping_loop, runner, interval, runner.spec.ping_timeout)
                self.ready = True
                log.info("supervisor.ready", supervisor=self.name, children=[r.name for r in self.runners])
                if on_ready is not None:
                    on_ready()
                try:
                    # shutdown() ends a restart still under way too (a remote worker whose host is
                    # gone waits up to its start timeout)
                    with self._supervising:
                        await self._supervise()
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._stop_all(self.runners)
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _first_real(group) from None
        finally:
            self._done.set()

    async def shutdown(self) -> None:
        """Stop all children in reverse start order (each within its deadline) and end `run()`."""
        self._shutdown.set()
        self._exits_send.send_nowait(("shutdown",))
        self._supervising.cancel()
        await self._done.wait()

    def tree(self) -> ActorInfo:
        """The live supervision tree below (and including) this supervisor."""
        return ActorInfo(
            name=self.name,
            kind="supervisor",
            placement="inprocess",
            pid=get_node().pid,
            state="running" if self.ready and not self._shutdown.is_set() else "stopping",
            restarts=0,
            mailbox_depth=None,
            started_at=None,
            children=[r.info() for r in self.runners],
        )

    def child(self, name: str) -> Runner:
        for runner in self.runners:
            if runner.name == name:
                return runner
        raise KeyError(name)

    # -- called by runners ------------------------------------------------------------------
    def child_exited(self, runner: Runner, incarnation: int, info: ExitInfo) -> None:
        self._exits_send.send_nowait((runner, incarnation, info))

    # -- internals --------------------------------------------------------------------------
    def _event(self, kind: str, child: str, detail: str = "") -> None:
        event = Event(time.time(), kind, child, detail)
        self.events.append(event)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as exc:  # a listener must not break supervision
                log.error("supervisor.listener_failed", error=repr(exc))

    async def _start(self, runner: Runner, timed: bool = True) -> None:
        log.info("actor.start", supervisor=self.name, actor=runner.name, placement=runner.placement)
        began = time.monotonic()
        try:
            await runner.start()
        finally:
            if timed:
                self._starting_seconds += time.monotonic() - began
        self._event("start", runner.name)

    async def _start_group(self, runners: list[Runner]) -> None:
        """Start `runners`: in order, or all at once with `start_together` (the time spent counted
        once); raises the first start failure once every start has ended."""
        if not self.spec.start_together or len(runners) < 2:
            for runner in runners:
                await self._start(runner)
            return
        failures: list[BaseException] = []

        async def one(runner: Runner) -> None:
            try:
                await self._start(runner, timed=False)
            except Exception as exc:
                failures.append(exc)

        began = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                for runner in runners:
                    tg.start_soon(one, runner)
        finally:
            self._starting_seconds += time.monotonic() - began
        if failures:
            raise failures[0]

    def _clock(self) -> float:
        """The restart-intensity clock: monotonic time, less the time spent starting children. A
        child that takes 15 s to load and crashes at once must still trip `max_restarts` within
        `period`, not get 4 restarts a minute forever."""
        return time.monotonic() - self._starting_seconds

    async def _stop(self, runner: Runner) -> None:
        if runner.running:
            await runner.stop()
            self._event("stop", runner.name)

    async def _stop_all(self, runners: list[Runner]) -> None:
        for runner in reversed(runners):
            try:
                await self._stop(runner)
            except Exception as exc:
                log.error("actor.stop_failed", actor=runner.name, error=repr(exc))

    async def _supervise(self) -> None:
        async for item in self._exits:
            if item[0] == "shutdown":
                return
            runner, incarnation, info = item
            if incarnation != runner.incarnation or runner not in self.runners:
                continue
            await self._handle_exit(runner, info)

    async def _handle_exit(self, runner: Runner, info: ExitInfo) -> None:
        if info.normal:
            log.info("actor.exit", supervisor=self.name, actor=runner.name, reason=info.reason)
            self._event("exit", runner.name, info.reason)
        else:
            log.error(
                "actor.crash",
                supervisor=self.name,
                actor=runner.name,
                reason=info.reason,
                traceback=info.error.traceback if info.error else None,
            )
            self._event("crash", runner.name, info.reason)
        restart = runner.spec.restart
        if restart == "temporary" or (restart == "transient" and info.normal):
            if restart == "temporary":
                self.runners.remove(runner)
            return
        now = self._clock()
        self._restarts.append(now)
        while self._restarts and self._restarts[0] < now - self.spec.period:
            self._restarts.popleft()
        if len(self._restarts) > self.spec.max_restarts:
            reason = (
                f"{len(self._restarts)} restarts within {self.spec.period} s "
                f"(max {self.spec.max_restarts}); last: {runner.name} {info.reason}"
            )
            log.error("supervisor.give_up", supervisor=self.name, reason=reason)
            self._event("give_up", runner.name, reason)
            raise SupervisorGaveUp(self.name, reason)
        index = self.runners.index(runner)
        if self.spec.strategy == "one_for_one":
            group = [runner]
        elif self.spec.strategy == "one_for_all":
            group = [r for r in self.runners if r is runner or r.running]
        else:  # rest_for_one
            group = [runner] + [r for r in self.runners[index + 1 :] if r.running]
        with anyio.CancelScope(shield=True):  # a shutdown ends the restart's starts, not its stops
            await self._stop_all([r for r in group if r is not runner])
        together = self.spec.start_together
        for r in group:
            r.restarts += 1
            log.info("actor.restart", supervisor=self.name, actor=r.name, restarts=r.restarts, cause=runner.name)
            self._event("restart", r.name, f"after {runner.name}: {info.reason}")
            if not together:  # each one started before the next restarts
                try:
                    await self._start(r)
                except Exception as exc:
                    self._restart_failed(r, exc)
                    return
        if together:
            try:
                await self._start_group(group)
            except Exception as exc:
                self._restart_failed(next(r for r in group if not r.running), exc)

    def _restart_failed(self, runner: Runner, exc: Exception) -> None:
        """A restart that failed counts as one more crash of `runner`."""
        log.error("actor.restart_failed", actor=runner.name, error=repr(exc))
        self.child_exited(runner, runner.incarnation, ExitInfo(False, "failed to restart"))

    async def _ping_loop(self, runner: Runner, interval: float, timeout: float) -> None:
        while True:
            await anyio.sleep(interval)
            if runner.state != "running" or runner.ref is None or runner not in self.runners:
                continue
            incarnation = runner.incarnation
            try:
                runner.last_pong = await runner.ref.ask(Ping(), timeout=timeout)
            except AskTimeout:
                if runner.incarnation == incarnation and runner.state == "running":
                    log.error(
                        "actor.hung",
                        supervisor=self.name,
                        actor=runner.name,
                        reason=f"no answer to a ping within {timeout} s",
                    )
                    self._event("hung", runner.name)
                    await runner.fail(f"hung: no answer to a ping within {timeout} s")
            except (ActorNotFound, ActorError):
                pass


@asynccontextmanager
async def supervise(spec: SupervisorSpec) -> AsyncIterator[Supervisor]:
    """Run a supervision tree for the duration of the block (the block is its parent).

    When the tree gives up, the block is cancelled and `SupervisorGaveUp` is raised from it.
    """
    node = get_node()
    node.users += 1
    sup = Supervisor(spec)
    try:
        async with anyio.create_task_group() as tg:
            ready = anyio.Event()
            failed: list[BaseException] = []

            async def _run() -> None:
                try:
                    await sup.run(on_ready=ready.set)
                except BaseException as exc:
                    failed.append(exc)
                    ready.set()
                    raise

            tg.start_soon(_run)
            await ready.wait()
            if failed:
                raise failed[0]
            try:
                yield sup
            finally:
                with anyio.CancelScope(shield=True):
                    await sup.shutdown()
    except BaseExceptionGroup as group:
        raise _first_real(group) from None
    finally:
        node.users -= 1
        if node.users == 0:
            node.close()


def run_root(spec: SupervisorSpec, main: Callable[[Supervisor], "anyio.abc.Awaitable | None"] | None = None) -> int:
    """Run `spec` as this process's root supervisor until SIGTERM/SIGINT (or `main` returns).

    Returns the process exit code: 0 after an orderly stop, 1 when the tree gave up (so systemd
    or Kubernetes restart the server rather than believing it ended well).
    """

    async def _root() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with supervise(spec) as sup:
                async with anyio.create_task_group() as tg:

                    async def _signals() -> None:
                        async for sig in signals:
                            log.info("supervisor.signal", signal=signal.Signals(sig).name)
                            tg.cancel_scope.cancel()
                            return

                    tg.start_soon(_signals)
                    if main is not None:
                        await main(sup)
                        tg.cancel_scope.cancel()

    try:
        anyio.run(_root, backend="asyncio")
    except SupervisorGaveUp as exc:
        log.error("supervisor.root_exit", reason=str(exc), code=1)
        return 1
    return 0


def _first_real(group: BaseExceptionGroup) -> BaseException:
    """The exception that matters in an anyio group: the first that is not a cancellation."""
    leaves = exception_leaves(group)
    cancelled = anyio.get_cancelled_exc_class()
    real = [e for e in leaves if not isinstance(e, cancelled)]
    for exc in real[1:]:
        log.error("actor.extra_error", error=repr(exc))
    return real[0] if real else leaves[0]
