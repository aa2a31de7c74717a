"""`--api-server-count N`: N API server processes over the one engine.

The process that runs `sonar serve` owns the supervision tree: its frontend (API server 0), the
engine, and, with N > 1, a supervisor ``api-servers`` over ``api1`` .. ``api{N-1}``: each an
`ApiServerActor` in its own child process (an actor host, `python -m sonar actor`), running the
same HTTP app as the frontend over its own `LLM` handle. That handle reaches the owner's
scheduler, worker and detokenizer through their actor refs, over the transport's private ipc
sockets (a 0700 directory of the owner's, each link authenticated: `sonar.actors.node`); its
own client actor is the sink the detokenizer sends that server's outputs to, so tokens flow
engine -> API server without a detour through the owner. Every API server binds the port with
SO_REUSEPORT (`sonar.http.frontend.shared_port_socket`) and the kernel spreads connections over
them; each response names its server in ``x-sonar-api-server``.

Their `/metrics` and `/load` are every server's (`share_metrics`): the owner creates a private
directory before any server starts (removing those a killed owner left: `sweep_metrics`) and names
it in ``PROMETHEUS_MULTIPROC_DIR``, which the API server processes inherit; each writes its
per-request series there (prometheus_client's multiprocess files, one set per pid) and a scrape of
any of them sums them all
(`sonar.http.metrics`). A dead server's counters stay in the sum; its in-flight count is dropped
(`mark_process_dead`) once the owner's tree shows it gone (`feed`).

What only the owner sees reaches the others as messages: the engine's supervision events (a
crashed scheduler or detokenizer lost its requests; the engine gave up) as `EngineEvent`, the
live tree for `/actors` and `/metrics` as `EngineTree` every `TREE_INTERVAL` seconds. A signal
drains every API server (`SetPhase`, `GetFrontendStatus`, `AbortInFlight`). An API server that
dies is restarted alone (one_for_one, `RESTARTS` in `PERIOD` seconds, then the server exits 1);
the others keep their requests. What lives in one API server's memory and cannot be shared
(LoRA registry, data-parallel router, sleep and weight-update drains, the Responses store) is
refused at startup (`sonar.cli.parse`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import sys
import tempfile
from typing import Any, Iterator, Union

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import ActorRef, Ask, ChildProcess, ChildSpec, SiblingRef, SupervisorSpec
from sonar.actors.actor import launch
from sonar.actors.tree import ActorInfo
from sonar.http.frontend import FrontendActor, FrontendStatus, GetFrontendStatus, SetPhase
from sonar.log import get_logger

log = get_logger("sonar.api_servers")

SUPERVISOR = "api-servers"
RESTARTS = 5
"""Restarts of the API server processes within `PERIOD` seconds before the server gives up."""
PERIOD = 60.0
START_TIMEOUT = 120.0
"""Seconds an API server process has to import the app, load the tokenizer and listen."""
TREE_INTERVAL = 1.0
"""Seconds between the owner's snapshots of the supervision tree sent to the other API servers."""


def server_name(index: int) -> str:
    return f"api{index}"


class EngineEvent(msgspec.Struct, tag="api.engine_event"):
    """A supervision event of the engine tree, as the owner's supervisor saw it."""

    kind: str
    child: str
    detail: str


class EngineTree(msgspec.Struct, tag="api.engine_tree"):
    """The owner's live supervision tree (`/actors`, the restart and liveness metrics)."""

    tree: ActorInfo


class AbortInFlight(Ask, tag="api.abort"):
    """End this API server's requests in flight with finish_reason "abort" (shutdown)."""

    reply_type = list[str]


ApiServerMsg = Union[GetFrontendStatus, SetPhase, AbortInFlight, EngineEvent, EngineTree]


METRICS_PREFIX = "sonar-metrics-"


def sweep_metrics(parent: str) -> list[str]:
    """Remove the metrics directories in `parent` that a killed owner left (SIGKILL skips its
    cleanup): this user's ``sonar-metrics-PID-*`` whose PID is not running. The paths removed."""
    removed = []
    for name in os.listdir(parent):
        if not name.startswith(METRICS_PREFIX):
            continue
        pid, _, _ = name[len(METRICS_PREFIX) :].partition("-")
        path = os.path.join(parent, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or _running(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def share_metrics() -> str:
    """Create the private (0700) directory the API servers share their metrics in and name it in
    this process's environment, which the API server processes inherit; its path (the caller
    removes it at exit). prometheus_client reads the variable when it is imported: if it was
    imported already (an operator's middleware), its value class is picked again, so the
    instruments the app creates later write to the directory."""
    from sonar.http.metrics import MULTIPROC_ENV

    sweep_metrics(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    os.environ[MULTIPROC_ENV] = path
    values = sys.modules.get("prometheus_client.values")
    if values is not None and not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()  # type: ignore[attr-defined]
    return path


def server_pids(tree: ActorInfo) -> set[int]:
    """The pids of the API server processes 1 .. N-1 in the owner's tree."""
    servers = tree.find(SUPERVISOR)
    return set() if servers is None else {c.pid for c in servers.children if c.pid is not None}


def api_servers_spec(
    count: int,
    uvicorn_args: dict[str, Any],
    frontend: dict[str, Any],
    settings: Any,
    middleware: tuple[str, ...],
    engine_config: Any,
    model_name: str,
) -> SupervisorSpec:
    """The supervisor over API servers 1 .. `count` - 1 (started after the engine, which they
    reach through their siblings' refs). `frontend`: the frontend actor's settings besides
    `uvicorn_args`; `settings`: the app's `ServerSettings`, whose `middleware` (loaded objects)
    each process loads again from the `middleware` paths."""
    from sonar.engine.tree import worker_path

    engine = "../engine/"
    kwargs: dict[str, Any] = {
        "uvicorn_args": uvicorn_args,
        "frontend": frontend,
        "settings": msgspec.to_builtins(dataclasses.replace(settings, middleware=())),
        "middleware": list(middleware),
        "engine_config": msgspec.to_builtins(engine_config),
        "model_name": model_name,
        "scheduler": SiblingRef(engine + "scheduler"),
        "worker": SiblingRef(engine + worker_path(engine_config)),
        "detokenizer": SiblingRef(engine + "detokenizer"),
    }
    if engine_config.offload_manager_needed:
        kwargs["offload"] = SiblingRef(engine + "offload")
    children: list[Any] = [
        ChildSpec(
            server_name(index),
            "sonar.cli.api_servers:ApiServerActor",
            kwargs={**kwargs, "index": index},
            protocol=ApiServerMsg,
            placement=ChildProcess(start_timeout=START_TIMEOUT),
            ping_interval=2.0,
            ping_timeout=15.0,
            shutdown=10.0,
        )
        for index in range(1, count)
    ]
    return SupervisorSpec(
        SUPERVISOR, children, strategy="one_for_one", max_restarts=RESTARTS, period=PERIOD, start_together=True
    )


class _Child:
    """A `RemoteEngine` child as `LLM` reads it: an actor with a ref."""

    kind = "actor"

    def __init__(self, ref: ActorRef) -> None:
        self.ref = ref


class RemoteEngine:
    """The owner's engine tree as an API server process sees it: the refs of its actors, which
    stay valid across their restarts (same mailbox, same address), and the last tree snapshot
    the owner sent. It stands in for the engine's `Supervisor` under an `LLM`."""

    def __init__(self, refs: dict[str, ActorRef]) -> None:
        self.refs = refs
        self.snapshot: ActorInfo | None = None
        self.listeners: list[Any] = []

    def child(self, name: str) -> _Child:
        ref = self.refs.get(name)
        if ref is None:
            raise KeyError(f"the engine runs no actor {name!r}")
        return _Child(ref)

    def tree(self) -> ActorInfo:
        if self.snapshot is None:  # the owner's first snapshot is under `TREE_INTERVAL` away
            return ActorInfo("sonar", "supervisor", "inprocess", None, "starting", 0, None, None)
        return self.snapshot


class ApiServerActor(FrontendActor):
    """API server `index` (1 or more): the frontend actor serving the app on its own `LLM` over
    the owner's engine (see the module docstring)."""

    protocol = ApiServerMsg

    def __init__(
        self,
        index: int,
        uvicorn_args: dict[str, Any],
        frontend: dict[str, Any],
        settings: dict[str, Any],
        middleware: list[str],
        engine_config: dict[str, Any],
        model_name: str,
        scheduler: ActorRef,
        worker: ActorRef,
        detokenizer: ActorRef,
        offload: ActorRef | None = None,
    ) -> None:
        super().__init__(uvicorn_args, **frontend, server_index=index)
        self.index = index
        self.settings = settings
        self.middleware = middleware
        self.engine_config = engine_config
        self.model_name = model_name
        refs = {"scheduler": scheduler, "worker": worker, "detokenizer": detokenizer}
        if offload is not None:
            refs["offload"] = offload
        self.engine = RemoteEngine(refs)
        self.llm: Any = None

    async def started(self) -> None:
        """Attach an `LLM` to the engine, build the app on it, then listen."""
        from sonar.engine import tokenizers
        from sonar.engine.client_actor import ClientActor, DeltaStream
        from sonar.engine.config import EngineConfig
        from sonar.engine.llm import LLM
        from sonar.http.app import build_app
        from sonar.http.middleware import load_middleware
        from sonar.http.settings import ServerSettings
        from sonar.protocol.engine import DescribeWorker

        config = msgspec.convert(self.engine_config, EngineConfig)
        settings = msgspec.convert(self.settings, ServerSettings)
        settings = dataclasses.replace(settings, middleware=tuple(load_middleware(self.middleware)))
        streams: dict[str, DeltaStream] = {}
        client = await launch(self.task_group, ClientActor(streams), f"client-{secrets.token_hex(4)}", 4096)
        info = await self.engine.refs["worker"].ask(DescribeWorker(), timeout=60)
        tokenizer = await anyio.to_thread.run_sync(tokenizers.load, config.tokenizer or info.tokenizer_path)
        llm = LLM(config, self.engine, client.ref, streams, info, tokenizer)  # type: ignore[arg-type]
        llm.model_name = self.model_name
        llm.root = self.engine  # type: ignore[assignment]
        self.llm = llm
        self.door.app = build_app(llm, settings)
        self.drain.phase = "serving"
        await super().started()
        log.info("api_server.serving", index=self.index)

    async def handle(self, msg: ApiServerMsg) -> Any:
        if isinstance(msg, EngineTree):
            self.engine.snapshot = msg.tree
            return None
        if isinstance(msg, EngineEvent):
            lose_requests(self.llm, msg)
            return None
        if isinstance(msg, AbortInFlight):
            from sonar.http.lifecycle import abort_all

            return [] if self.llm is None else await abort_all(self.llm)
        return await super().handle(msg)


def lose_requests(llm: Any, event: EngineEvent) -> None:
    """What an engine event means for an API server's requests (as `sonar.engine.client` does
    for the owner's): a restarted scheduler or detokenizer lost them, a tree that gave up ends
    them and every later one."""
    if event.kind == "crash" and event.child in ("scheduler", "detokenizer"):
        llm.fail_replica(None, f"the {event.child} of the engine crashed ({event.detail}); request lost")
    elif event.kind == "give_up":
        llm.dead = f"the engine gave up after repeated crashes ({event.detail})"
        llm.fail_replica(None, llm.dead)


def api_server_refs(root: Any) -> list[ActorRef]:
    """The refs of API servers 1 .. N-1 under `sonar serve`'s root supervisor (none with one)."""
    try:
        sup = root.child(SUPERVISOR).child
    except KeyError:
        return []
    return [] if sup is None else [runner.ref for runner in sup.runners if runner.ref is not None]


def frontends(root: Any) -> Iterator[ActorRef]:
    """Every API server's frontend actor, the owner's first."""
    yield root.child("frontend").ref
    yield from api_server_refs(root)


async def feed(root: Any, engine: Any) -> None:
    """Keep the other API servers' view of the engine current until cancelled: forward the
    engine's supervision events, send the tree every `TREE_INTERVAL` seconds and as soon as an
    API server (re)started."""
    events: list[EngineEvent] = []
    wake = anyio.Event()

    def on_event(event: Any) -> None:
        events.append(EngineEvent(event.kind, event.child, str(event.detail)))
        wake.set()

    def on_server_event(event: Any) -> None:
        if event.kind == "start":
            wake.set()

    servers = root.child(SUPERVISOR).child
    engine.listeners.append(on_event)
    servers.listeners.append(on_server_event)
    from sonar.http.metrics import shared_metrics_dir

    shared, pids = shared_metrics_dir(), set[int]()
    try:
        while True:
            wake = anyio.Event()
            sending, events[:] = list(events), []
            tree = EngineTree(root.tree())
            if shared is not None:
                pids = forget_dead(pids, server_pids(tree.tree), shared)
            for ref in api_server_refs(root):
                for msg in (*sending, tree):
                    await _send(ref, msg)
            with anyio.move_on_after(TREE_INTERVAL):
                await wake.wait()
    finally:
        engine.listeners.remove(on_event)
        servers.listeners.remove(on_server_event)


def forget_dead(before: set[int], now: set[int], path: str) -> set[int]:
    """Drop the in-flight counts of the API server processes in `before` that are gone `now`
    from the shared metrics directory `path` (their counters stay); `now`."""
    from prometheus_client.multiprocess import mark_process_dead

    for pid in before - now:
        mark_process_dead(pid, path)
    return now


async def _send(ref: ActorRef, msg: Any) -> None:
    """Best effort: a server that is restarting gets the next snapshot (its requests died with it)."""
    try:
        with anyio.fail_after(1.0):
            await ref.send(msg)
    except Exception as exc:
        log.debug("api_server.unreachable", server=ref.label, error=f"{type(exc).__name__}: {exc}")


async def tell_all(root: Any, msg: Any) -> list[FrontendStatus]:
    """Ask every API server `msg` (`SetPhase`, `GetFrontendStatus`); the answers of those that
    answered."""
    from sonar.actors import ActorError, ActorNotFound, AskTimeout

    answers: list[FrontendStatus] = []
    for ref in frontends(root):
        try:
            answers.append(await ref.ask(msg, timeout=5.0))
        except (ActorError, ActorNotFound, AskTimeout):
            continue
    return answers


async def abort_others(root: Any) -> list[str]:
    """End the requests in flight on API servers 1 .. N-1; their engine request ids."""
    from sonar.actors import ActorError, ActorNotFound, AskTimeout

    aborted: list[str] = []
    for ref in api_server_refs(root):
        try:
            aborted += await ref.ask(AbortInFlight(), timeout=5.0)
        except (ActorError, ActorNotFound, AskTimeout):
            continue
    return aborted
