"""An actor host process: `python -m sonar actor`.

A host runs actors on behalf of a supervisor in another process. As a child (`--parent`), it
binds the address its supervisor chose, says hello, runs the one actor it is asked to spawn and
exits when that actor ends (0 after a normal exit, 1 after a crash) or when its parent dies. As a
remote host (`--listen tcp://host:port`) it stays up and runs whatever supervisors spawn on it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from typing import Any, Union

import anyio
import msgspec

from sonar.actors.actor import NO_REPLY, Actor, Incarnation, launch
from sonar.actors.codec import resolve
from sonar.actors.messages import Ask, ExitInfo
from sonar.actors.node import get_node
from sonar.log import get_logger

log = get_logger("sonar.actors")

HOST_NAME = "_host"


class Spawned(msgspec.Struct):
    pid: int


class Spawn(Ask, tag="sonar.spawn"):
    """Start actor `target(**kwargs)` under `name`; replies once it is ready."""

    name: str
    target: str
    kwargs: dict[str, Any] = {}
    mailbox_size: int = 1024
    display: str | None = None
    reply_type = Spawned


class Monitor(Ask, tag="sonar.monitor"):
    """Replies with an `ExitInfo` when the actor named `name` ends (immediately if none runs)."""

    name: str
    reply_type = ExitInfo


class Kill(Ask, tag="sonar.kill"):
    """Cancel the actor named `name` where it stands."""

    name: str


HostMsg = Union[Spawn, Monitor, Kill]


class HostActor(Actor):
    protocol = HostMsg

    def __init__(self, exit_with_actor: bool) -> None:
        self.exit_with_actor = exit_with_actor
        self.actors: dict[str, Incarnation] = {}
        self.finished = anyio.Event()
        self.exit_code = 0

    async def handle(self, msg: HostMsg) -> Any:
        if isinstance(msg, Spawn):
            old = self.actors.get(msg.name)
            if old is not None and not old.done.is_set():
                old.kill("replaced")
                with anyio.move_on_after(5):
                    await old.done.wait()
            cls = resolve(msg.target)
            actor = cls(**msg.kwargs)
            inc = await launch(self.task_group, actor, msg.name, msg.mailbox_size, msg.display)
            self.actors[msg.name] = inc
            self.task_group.start_soon(self._after_exit, msg.name, inc)
            log.info("actor.spawned", actor=msg.name, pid=os.getpid())
            return Spawned(os.getpid())
        if isinstance(msg, Monitor):
            inc = self.actors.get(msg.name)
            if inc is None:
                return ExitInfo(False, "not running")
            self.task_group.start_soon(self._answer_monitor, inc, msg.reply_to)
            return NO_REPLY
        if isinstance(msg, Kill):
            inc = self.actors.get(msg.name)
            if inc is not None:
                inc.kill("killed")
                with anyio.move_on_after(1):
                    await inc.done.wait()
            return None
        raise TypeError(f"unexpected {msg!r}")

    async def _answer_monitor(self, inc: Incarnation, reply_to: Any) -> None:
        await inc.done.wait()
        assert inc.exit is not None
        await self.reply(reply_to, inc.exit)

    async def _after_exit(self, name: str, inc: Incarnation) -> None:
        await inc.done.wait()
        assert inc.exit is not None
        if inc.exit.normal:
            log.info("actor.exited", actor=name, reason=inc.exit.reason)
        else:
            log.error("actor.crashed", actor=name, reason=inc.exit.reason,
                      error=inc.exit.error.traceback if inc.exit.error else None)
        if self.exit_with_actor and self.actors.get(name) is inc:
            self.exit_code = 0 if inc.exit.normal else 1
            await anyio.sleep(0.05)  # let the monitor reply go out first
            self.finished.set()


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when our parent dies (Linux), then check it is still there."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(3)


async def _watch_parent(parent_pid: int) -> None:
    while True:
        await anyio.sleep(0.5)
        if os.getppid() != parent_pid:
            log.warning("actor.parent_gone", parent=parent_pid)
            os._exit(3)


async def _host_main(args: argparse.Namespace) -> int:
    node = get_node()
    address = node.ensure_bound(args.bind or args.listen)
    host = HostActor(exit_with_actor=args.parent is not None)
    try:
        async with anyio.create_task_group() as tg:
            await launch(tg, host, HOST_NAME, 256)
            if args.parent is not None:
                tg.start_soon(_watch_parent, args.parent_pid)
                await node.say_hello(args.parent, args.key)
            else:
                log.info("actor.host_listening", address=address, pid=os.getpid())
            await host.finished.wait()
            tg.cancel_scope.cancel()
        return host.exit_code
    finally:
        node.close(linger_ms=500)
        if args.parent is not None:
            # A child has nothing left to clean up: skip the interpreter's slow teardown.
            sys.stderr.flush()
            os._exit(host.exit_code)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sonar actor", description="Run an actor host process.")
    ap.add_argument("--listen", help="serve supervisors at this address (tcp://host:port)")
    ap.add_argument("--parent", help="address of the parent node (child mode)")
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--key", default="")
    ap.add_argument("--bind", help="address to bind in child mode")
    args = ap.parse_args(argv)
    if (args.listen is None) == (args.parent is None):
        ap.error("give exactly one of --listen or --parent")
    if args.parent is not None:
        _die_with_parent(args.parent_pid)
    try:
        return anyio.run(_host_main, args, backend="asyncio")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
