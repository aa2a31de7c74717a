"""Small helpers shared by the runtime tests."""

import os
import time


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


async def wait_for(predicate, timeout: float = 60.0, interval: float = 0.02):
    """Poll `predicate` until it is true; fail the test after `timeout` seconds. The default is the
    process placements' start timeout: on a loaded CI machine one child process took 20 s to spawn
    and import, so a restart of two of them does not fit in 10 s."""
    import anyio

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await anyio.sleep(interval)


def other_pids() -> set[int]:
    """Live child processes of this test process."""
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(") ")[1].split()
                if int(fields[1]) == me and fields[0] != "Z":
                    out.add(int(entry))
            except (FileNotFoundError, IndexError, ProcessLookupError):
                pass
    return out


def free_tcp_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def start_host(address: str, keys_dir, *extra: str, log_path=None):
    """`python -m sonar actor --listen ADDRESS --keys DIR ...` as another machine would run it,
    allowed to spawn the test actor `Sample`; its log goes to `log_path` when given."""
    import subprocess
    import sys

    err = open(log_path, "w") if log_path is not None else None
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sonar",
                "actor",
                "--listen",
                address,
                "--keys",
                str(keys_dir),
                "--allow-actor",
                "tests.actors.sample:Sample",
                *extra,
            ],
            env=dict(os.environ, PYTHONPATH=os.getcwd()),
            stderr=err,
        )
    finally:
        if err is not None:
            err.close()


def stop_host(proc) -> None:
    proc.terminate()
    proc.wait(timeout=10)
