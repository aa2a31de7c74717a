"""Start a server as a subprocess for `bench startup` and `bench sweep`, wait for it, stop it.

The default command is ``python -m sonar serve --host 127.0.0.1 --port PORT ARGS...``;
``--server-command`` replaces it (e.g. ``"vllm serve /models/smol"``; ``{port}`` in it is
replaced by the chosen port, else ``--host 127.0.0.1 --port PORT`` is appended).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

from sonar.errors import SonarError

#: The line the server prints once it is ready: ``sonar serve: startup: weights=1.2 convert=0.3 ...``.
STARTUP_LINE = "sonar serve: startup:"
_PAIR = re.compile(r"([A-Za-z_][\w.\-]*)\s*=\s*([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*(ms|s)?\b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_startup_phases(text: str) -> dict[str, float]:
    """The ``phase=seconds`` pairs of the server's startup line (the last one printed), in seconds;
    values may carry an ``s`` or ``ms`` suffix, anything that is not such a pair is ignored."""
    phases: dict[str, float] = {}
    for line in text.splitlines():
        at = line.find(STARTUP_LINE)
        if at < 0:
            continue
        phases = {}
        for key, value, unit in _PAIR.findall(line[at + len(STARTUP_LINE) :]):
            phases[key] = float(value) / (1000.0 if unit == "ms" else 1.0)
    return phases


def server_command(port: int, server_args: Sequence[str], command: str | None = None) -> list[str]:
    """The argv that starts the server on `port` (see the module docstring)."""
    if not command:
        return [sys.executable, "-m", "sonar", "serve", "--host", "127.0.0.1", "--port", str(port), *server_args]
    argv = [part.replace("{port}", str(port)) for part in shlex.split(command)]
    if "{port}" not in command:
        argv += ["--host", "127.0.0.1", "--port", str(port)]
    return argv + list(server_args)


@dataclass
class LaunchedServer:
    """A server subprocess; its stdout and stderr go to files in `log_dir`."""

    proc: subprocess.Popen
    base_url: str
    stdout: Path
    stderr: Path
    started: float
    ready_seconds: float = 0.0
    argv: list[str] = field(default_factory=list)

    def out(self) -> str:
        return self.stdout.read_text(errors="replace")

    def err(self) -> str:
        return self.stderr.read_text(errors="replace")


class ServerFailed(SonarError, RuntimeError):
    """The server exited, or did not answer /health in time."""


def launch(
    server_args: Sequence[str],
    log_dir: Path,
    *,
    command: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    name: str = "server",
    new_session: bool = False,
) -> LaunchedServer:
    """Start the server and wait until ``GET /health`` answers 200; raises `ServerFailed`.
    `new_session` makes it lead a process group of its own (to pause or stop it with its children)."""
    port = free_port()
    argv = server_command(port, server_args, command)
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{name}.out", log_dir / f"{name}.err"
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **(env or {}))
    started = time.perf_counter()
    with out.open("wb") as fout, err.open("wb") as ferr:
        proc = subprocess.Popen(argv, env=full_env, stdout=fout, stderr=ferr, start_new_session=new_session)
    server = LaunchedServer(proc, f"http://127.0.0.1:{port}", out, err, started, argv=argv)
    try:
        _wait_ready(server, timeout)
    except BaseException:
        # timed out, or interrupted (Ctrl-C, a bench's SIGTERM handler): the caller never gets
        # this server, so it is stopped here rather than left running
        stop(server)
        raise
    return server


def _wait_ready(server: LaunchedServer, timeout: float) -> None:
    """Poll ``GET /health`` until it answers 200 (setting `ready_seconds`); raises `ServerFailed`."""
    with httpx.Client(timeout=2.0) as client:
        while time.perf_counter() - server.started < timeout:
            if server.proc.poll() is not None:
                raise ServerFailed(
                    f"the server exited with {server.proc.returncode} before it was ready "
                    f"({' '.join(server.argv)}):\n{server.err()[-3000:]}"
                )
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    server.ready_seconds = time.perf_counter() - server.started
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise ServerFailed(f"the server did not answer /health within {timeout:.0f} s:\n{server.err()[-3000:]}")


def split_server_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """A bench command line split at its first ``--``: (the bench's own arguments, the server's)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def stop(server: LaunchedServer, timeout: float = 30.0) -> int:
    """SIGTERM the server, wait for it (SIGKILL after `timeout`); its exit code."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    return server.proc.returncode
