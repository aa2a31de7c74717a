"""The frontend's shared port (`--api-server-count` > 1): several sockets bind it with SO_REUSEPORT,
but the first API server refuses a port something already listens on, so a stale server cannot
quietly share it with a new one."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from sonar.http.frontend import check_port_free, shared_port_socket
from tests.http.conftest import ROOT


def listening(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_shared_sockets_bind_one_port_and_the_port_check_sees_any_listener() -> None:
    with listening() as plain:
        port = plain.getsockname()[1]
        with pytest.raises(OSError):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)
    first, second = shared_port_socket("127.0.0.1", port), shared_port_socket("127.0.0.1", port)
    with first, second:
        first.listen()
        second.listen()
        with pytest.raises(OSError):
            check_port_free("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def test_serve_with_two_api_servers_refuses_a_port_in_use() -> None:
    with listening() as taken:
        port = taken.getsockname()[1]
        argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "-asc", "2", "--max-stored-responses", "0"]
        done = subprocess.run(
            [sys.executable, "-m", "sonar", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 1
    assert (
        "cannot listen on 127.0.0.1" in done.stderr + done.stdout
        and "Address already in use" in done.stderr + done.stdout
    )
