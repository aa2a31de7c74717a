"""An actor host process: `python -m sonar actor`.

A host runs actors on behalf of a supervisor in another process. As a child (`--parent`), it
binds the address its supervisor chose, says hello, runs the one actor it is asked to spawn and
exits when that actor ends (0 after a normal exit, 1 after a crash) or when its parent dies. As a
remote host (`--listen tcp://host:port`) it stays up and runs what authenticated supervisors
spawn on it; it refuses to start without deployment keys (`--keys DIR` or `SONAR_ACTOR_KEYS`,
made by `python -m sonar actor keygen DIR`).

The host actor outlives everything a peer asks of it: it spawns only actor classes on the
allow-list (`sonar.actors.allow`), a spawn that fails is an error reply, and an actor is
replaced, killed or stopped only at the word of the client key that spawned it. Its own mailbox
takes no `Stop` from a peer. Each refusal is an error reply and an `actor.message_refused` line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import ipaddress
import os
import signal
import sys
from typing import Any, Union
from urllib.parse import urlsplit

import anyio
import msgspec

from sonar import heap
from sonar.actors import allow, keys
from sonar.actors.actor import NO_REPLY, Actor, Incarnation, launch
from sonar.actors.messages import Ask, ExitInfo, RemoteError
from sonar.actors.node import MAX_FRAME_ENV, configure_transport, get_node
from sonar.errors import SonarError
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
    owner: str | None = None
    """Set by the receiving node to the client key of the peer that sent it (a peer's own value
    is overwritten)."""
    reply_type = Spawned


class Monitor(Ask, tag="sonar.monitor"):
    """Replies with an `ExitInfo` when the actor named `name` ends (immediately if none runs)."""

    name: str
    reply_type = ExitInfo


class Kill(Ask, tag="sonar.kill"):
    """Cancel the actor named `name` where it stands."""

    name: str


HostMsg = Union[Spawn, Monitor, Kill]


class HostEnding(SonarError, RuntimeError):
    """A Spawn at a host that has run its one actor (``--exit-with-actor``) and is exiting: the
    spawn belongs to its successor at the same address (`RemoteRunner` asks again)."""


class HostActor(Actor):
    protocol = HostMsg

    def __init__(self, exit_with_actor: bool) -> None:
        self.exit_with_actor = exit_with_actor
        self.actors: dict[str, Incarnation] = {}
        self.owners: dict[str, str | None] = {}  # actor name -> client key of the peer that spawned it
        self.finished = anyio.Event()
        self.exit_code = 0

    async def started(self) -> None:
        get_node().mailboxes[self.ref.name].guard = self.admit

    def admit(self, msg: Any, peer: str | None) -> str | None:
        """Why a peer's message must not reach the host actor, or None (see the module doc)."""
        if isinstance(msg, Spawn):
            msg.owner = peer
            if not allow.actor_allowed(msg.target):
                return f"actor class {msg.target!r} is not on this host's allow-list"
            if self._running(msg.name) and self.owners.get(msg.name) != peer:
                return f"actor {msg.name!r} was spawned by another supervisor"
        elif isinstance(msg, Kill):
            if self._running(msg.name) and self.owners.get(msg.name) != peer:
                return f"actor {msg.name!r} was spawned by another supervisor"
        return None

    def _running(self, name: str) -> bool:
        inc = self.actors.get(name)
        return inc is not None and not inc.done.is_set()

    async def handle(self, msg: HostMsg) -> Any:
        if isinstance(msg, Spawn):
            try:
                return await self._spawn(msg)
            except Exception as exc:  # the host lives on: the spawn's failure is the asker's answer
                log.error("actor.spawn_failed", actor=msg.name, target=msg.target, error=repr(exc))
                if msg.reply_to is not None:
                    await get_node().reply(msg.reply_to, error=RemoteError.from_exception(exc))
                return NO_REPLY
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

    async def _spawn(self, msg: Spawn) -> Spawned:
        if self.exit_with_actor and self.actors:
            raise HostEnding(f"this host ran its one actor and is exiting: spawn {msg.name!r} at its successor")
        cls = allow.load_actor(msg.target, Actor)
        old = self.actors.get(msg.name)
        if old is not None and not old.done.is_set():
            old.kill("replaced")
            with anyio.move_on_after(5):
                await old.done.wait()
        actor = cls(**msg.kwargs)
        try:
            inc = await launch(self.task_group, actor, msg.name, msg.mailbox_size, msg.display)
        finally:
            settled = heap.settle()  # a child's start ends with its actor's (`main` paused the collector)
            if settled is not None:
                log.info("heap.settled", frozen=settled.frozen, seconds=round(settled.seconds, 3), pid=os.getpid())
        inc.mailbox.owner = msg.owner
        self.actors[msg.name] = inc
        self.owners[msg.name] = msg.owner
        self.task_group.start_soon(self._after_exit, msg.name, inc)
        log.info("actor.spawned", actor=msg.name, target=msg.target, pid=os.getpid())
        return Spawned(os.getpid())

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
            log.error(
                "actor.crashed",
                actor=name,
                reason=inc.exit.reason,
                error=inc.exit.error.traceback if inc.exit.error else None,
            )
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
    if args.expect:
        node.await_mailbox(args.expect)
    address = node.ensure_bound(args.bind or args.listen)
    host = HostActor(exit_with_actor=args.parent is not None or args.exit_with_actor)
    try:
        async with anyio.create_task_group() as tg:
            await launch(tg, host, HOST_NAME, 256)
            if args.parent_pid:
                tg.start_soon(_watch_parent, args.parent_pid)
            if args.parent is not None:
                await node.say_hello(args.parent, args.hello)
            else:
                log.info("actor.host_listening", address=address, pid=os.getpid())
            await host.finished.wait()
            tg.cancel_scope.cancel()
        return host.exit_code
    finally:
        node.close(linger_ms=500)
        if host.exit_with_actor:
            # Nothing left to clean up (a rank's threads may still wait in a dead collective):
            # skip the interpreter's slow teardown.
            sys.stderr.flush()
            os._exit(host.exit_code)


def is_loopback(address: str) -> bool:
    """True for an address only this machine can reach (an ipc path, a loopback tcp host)."""
    if address.startswith("ipc://"):
        return True
    host = urlsplit(address.replace("tcp://", "http://", 1)).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keygen_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="sonar actor keygen",
        description="Write a deployment's CURVE keys into DIR (mode 0700): the server keypair (unless DIR has "
        "one), a client keypair (unless DIR has one) and the client's public key in DIR/authorized/. "
        "Copy DIR to every machine of the deployment; see docs/security.md.",
    )
    ap.add_argument("dir")
    ap.add_argument("--name", help="file name of this client's key in DIR/authorized/ (default: the host name)")
    args = ap.parse_args(argv)
    try:
        root = keys.keygen(args.dir, args.name)
        creds = keys.Credentials.from_dir(root)
    except (OSError, keys.KeysError) as exc:
        print(f"sonar actor keygen: {exc}", file=sys.stderr)
        return 2
    print(f"sonar actor: keys in {root} (this machine's client key: {creds.client_public.decode()})")
    return 0


def preload(module: str) -> bool:
    """Import `module` when an allowed actor class lives there (whether it was imported).

    A child imports its actor's module before it says hello: the parent gets on with its own
    start meanwhile, and the spawn that follows finds the module loaded. A failure is left for
    that spawn to report."""
    if not any(path.partition(":")[0] == module for path in allow.allowed_actors()):
        log.warning("actor.preload_refused", module=module, detail="no allowed actor class lives there")
        return False
    try:
        importlib.import_module(module)
    except Exception as exc:
        log.warning("actor.preload_failed", module=module, error=repr(exc))
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["keygen"]:
        return keygen_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="sonar actor", description="Run an actor host process (`keygen DIR` writes a deployment's keys)."
    )
    ap.add_argument("--listen", help="serve supervisors at this address (tcp://host:port); needs --keys")
    ap.add_argument(
        "--keys",
        metavar="DIR",
        help=f"the deployment's keys, as `sonar actor keygen DIR` writes them (default: ${keys.ENV_DIR})",
    )
    ap.add_argument(
        "--allow-actor",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="also spawn this actor class for supervisors (repeatable; the classes Sonar ships are "
        f"allowed already; ${allow.ENV} adds more, comma-separated)",
    )
    ap.add_argument(
        "--max-frame-bytes",
        type=int,
        metavar="N",
        help=f"largest message frame sent or accepted (default: ${MAX_FRAME_ENV} or 4 GiB)",
    )
    ap.add_argument(
        "--exit-with-actor",
        action="store_true",
        help="with --listen: exit once the first actor spawned here ends (a tensor-parallel rank: "
        "torch.distributed holds one group per process, so each incarnation needs a fresh one)",
    )
    ap.add_argument("--parent", help="address of the parent node (child mode)")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when the process with this pid, the parent, ends")
    ap.add_argument("--hello", default="", help="the id to say hello with (child mode)")
    ap.add_argument("--bind", help="address to bind in child mode")
    ap.add_argument(
        "--expect",
        metavar="NAME",
        help="the name of the actor about to be spawned: messages for it that arrive first wait for it (child mode)",
    )
    ap.add_argument(
        "--preload",
        metavar="MODULE",
        help="import the module of the actor about to be spawned before saying hello (child mode)",
    )
    args = ap.parse_args(argv)
    if (args.listen is None) == (args.parent is None):
        ap.error("give exactly one of --listen or --parent")
    if args.parent_pid:  # a child, or a listening host kept by a Ray actor on another node
        _die_with_parent(args.parent_pid)
    try:
        for target in args.allow_actor:
            allow.allow_actor(target)
        configure_transport(args.keys, args.max_frame_bytes)
        if args.parent is not None:
            if keys.take_from_env() is None:
                ap.error("child mode needs the parent's keys in the environment")
        elif keys.Credentials.from_env(os.environ) is None and not args.keys:
            where = "" if is_loopback(args.listen) else f" ({args.listen} is reachable from other machines)"
            print(
                f"sonar actor: refusing to listen without credentials{where}: a host accepts only "
                "supervisors holding its deployment's keys. Make them with `python -m sonar actor keygen DIR`, "
                f"copy DIR to the supervisor's machine, and start with --keys DIR (or {keys.ENV_DIR}=DIR).",
                file=sys.stderr,
            )
            return 2
    except (keys.KeysError, ValueError) as exc:
        print(f"sonar actor: {exc}", file=sys.stderr)
        return 2
    try:
        with heap.starting() if args.parent is not None else contextlib.nullcontext():
            if args.parent is not None and args.preload:
                preload(args.preload)
            return anyio.run(_host_main, args, backend="asyncio")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
