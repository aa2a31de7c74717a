"""The frontend actor: uvicorn serving the OpenAI app, as the first child of `sonar serve`'s root
supervisor.

It starts before the engine, so the port answers from the first second: every route says 503
("starting") until `serve` hands it the app on the engine (`ServeApp`); `serve` drains it or
marks it dead with `SetPhase` and reads its requests in flight with `GetFrontendStatus`. On a
polite stop (the root stopping, after a drain or because the engine gave up) it lets the
responses in flight go out, up to its shutdown deadline (after the engine gave up, for at least
`DEAD_GRACE`), then stops uvicorn. Its connections are
guarded (`sonar.http.connection`): a header read timeout and a cap on open connections.
"""

from __future__ import annotations

import os
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Sequence, Union

import anyio
import msgspec

from sonar.actors import Actor, Ask
from sonar.errors import SonarError
from sonar.http.lifecycle import Drain, FrontDoor
from sonar.log import get_logger

log = get_logger("sonar.frontend")

DEAD_GRACE = 1.0
"""Seconds the port keeps answering (503) after the engine gave up, before the process exits: a
load balancer or orchestrator polling `/health` sees the engine down rather than only a refused
connection."""


class FrontendStatus(msgspec.Struct):
    phase: str
    """"starting", "serving", "draining" or "dead" (`sonar.http.lifecycle.Drain`)."""
    in_flight: int
    """HTTP requests being answered."""


class GetFrontendStatus(Ask, tag="frontend.status"):
    reply_type = FrontendStatus


class ServeApp(Ask, tag="frontend.serve"):
    """Start serving `app` (the engine is ready). The app is a live object, so this message only
    travels in-process: the frontend always runs in the server's process (`serve`'s `root_spec`)."""

    app: Any
    reply_type = FrontendStatus


class SetPhase(Ask, tag="frontend.phase"):
    """Stop taking new requests: "draining" (a signal: those in flight finish) or "dead" (the
    engine gave up; `reason` goes into the 503s)."""

    phase: Literal["draining", "dead"]
    reason: str = ""
    reply_type = FrontendStatus


HttpFrontendMsg = Union[GetFrontendStatus, ServeApp, SetPhase]


class FrontendStartError(SonarError, RuntimeError):
    pass


class FrontendActor(Actor):
    """Owns the server's phase and its count of requests in flight (`Drain`); `serve` moves the
    phase and reads the count through messages only."""

    protocol = HttpFrontendMsg

    def __init__(
        self,
        uvicorn_args: dict[str, Any],
        request_id_headers: bool = False,
        max_header_count: int | None = None,
        quiet_paths: Sequence[str] = (),
        linger: float = 3.0,
        header_timeout: float = 10.0,
        max_connections: int = 2048,
        ssl_refresh: bool = False,
        listening: threading.Event | None = None,
        server_index: int | None = None,
    ) -> None:
        """`listening`: set once the server listens (the process may load what it serves then);
        `ssl_refresh`: reload the TLS files of `uvicorn_args` when they change (`sonar.http.tls`);
        `server_index`: this API server's number among several sharing the port
        (`--api-server-count`): the port is then bound with SO_REUSEPORT, and every response
        says which server answered (`API_SERVER_HEADER`)."""
        import uvicorn

        from sonar.http.connection import guarded_protocol

        self.drain = drain = Drain()
        self.door = FrontDoor(None, drain, request_id_headers=request_id_headers, max_header_count=max_header_count)
        self.server_index = server_index
        app: Any = self.door if server_index is None else _Stamped(self.door, server_index)
        self.server = _make_server(
            uvicorn.Config(app, lifespan="off", http=guarded_protocol(header_timeout, max_connections), **uvicorn_args)
        )
        _quiet_access_log(quiet_paths)  # after uvicorn.Config, which configures its loggers
        self.uds = uvicorn_args.get("uds")
        self.ssl_refresh = ssl_refresh
        self.tls_files = (
            uvicorn_args.get("ssl_certfile"),
            uvicorn_args.get("ssl_keyfile"),
            uvicorn_args.get("ssl_ca_certs"),
        )
        self.listening = listening
        self.linger = linger
        self.done = anyio.Event()
        self.dead_at: float | None = None
        """When the engine gave up (`SetPhase` "dead")."""

    async def started(self) -> None:
        failure: list[BaseException] = []
        self.task_group.start_soon(self._serve, failure)
        while not self.server.started and not self.done.is_set():
            await anyio.sleep(0.01)
        if not self.server.started:
            reason = failure[0] if failure else "uvicorn stopped"
            raise FrontendStartError(f"the HTTP server did not start: {reason}")
        if self.ssl_refresh:
            from sonar.http.tls import CertRefresher, TlsFiles

            certfile, keyfile, ca_certs = self.tls_files
            files = TlsFiles(certfile, keyfile, ca_certs)
            self.task_group.start_soon(CertRefresher(self.server.config.ssl, files).run)
        if self.listening is not None:
            self.listening.set()

    async def _serve(self, failure: list[BaseException]) -> None:
        try:
            if self.server_index is None:
                await self.server.serve()
            else:
                config = self.server.config
                if self.server_index == 0:  # the first to bind: nobody else may hold the port
                    check_port_free(config.host, config.port)
                await self.server.serve(sockets=[shared_port_socket(config.host, config.port)])
        except OSError as exc:  # the shared port's bind
            failure.append(RuntimeError(f"cannot listen on {self.server.config.host}:{self.server.config.port}: {exc}"))
        except SystemExit as exc:  # uvicorn exits when it cannot bind
            failure.append(RuntimeError(f"cannot listen (uvicorn exited with {exc.code})"))
        finally:
            if self.uds and os.path.exists(self.uds):  # uvicorn leaves the socket file behind
                os.unlink(self.uds)
            self.done.set()
        if self.server.started and not self.server.should_exit:
            raise RuntimeError("the HTTP server stopped by itself")

    async def handle(self, msg: HttpFrontendMsg) -> FrontendStatus:
        drain = self.drain
        if isinstance(msg, ServeApp):
            self.door.app = msg.app
            if drain.phase == "starting":
                drain.phase = "serving"
        elif isinstance(msg, SetPhase):
            drain.phase, drain.reason = msg.phase, msg.reason or drain.reason
            if msg.phase == "dead" and self.dead_at is None:
                self.dead_at = anyio.current_time()
        return FrontendStatus(drain.phase, drain.in_flight)

    async def stopping(self) -> None:
        if self.drain.phase in ("starting", "serving"):
            self.drain.phase = "draining"
        with anyio.move_on_after(self.linger):
            await self.drain.wait_idle(0.01)
            if self.dead_at is not None:  # health checks get to see the 503 before the port closes
                await anyio.sleep_until(self.dead_at + DEAD_GRACE)
        self.server.should_exit = True
        await self.done.wait()


API_SERVER_HEADER = "x-sonar-api-server"
"""With several API servers (`--api-server-count`): the number of the one that answered (0 is the
one in the process that runs the engine)."""


class _Stamped:
    """The ASGI app `app`, each of its HTTP responses carrying `API_SERVER_HEADER`."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (API_SERVER_HEADER.encode(), self.value)],
                }
            await send(message)

        await self.app(scope, receive, stamped)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE) when a socket listens on `host`:`port` already. SO_REUSEPORT
    would otherwise let a stale server of the same user share the port with the new one, each
    answering some of the connections."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no owner
        probe.bind(address)


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` with SO_REUSEPORT, so every API server process binds the
    same port and the kernel spreads new connections over them. Linux lets only processes of
    the same user join a port's group."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _make_server(uvicorn_config: Any) -> Any:
    """A uvicorn `Server` without its own signal handling: `serve` handles the signals, and
    uvicorn would re-raise them when it returns."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(uvicorn_config)


def _quiet_access_log(paths: Sequence[str]) -> None:
    """--disable-access-log-for-endpoints: drop uvicorn's access log lines for these paths (the
    query string aside), from the first request on."""
    import logging

    quiet = {p.strip() for p in paths if p.strip()}
    if not quiet:
        return

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            args = record.args
            if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
                return args[2].split("?", 1)[0] not in quiet
            return True

    logging.getLogger("uvicorn.access").addFilter(Quiet())
