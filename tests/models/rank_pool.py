"""Rank processes kept for many gloo worlds: the model tests' groups (`parallel_rank`, `ep_rank`,
`eplb_rank`) run one process per rank, and starting one (importing torch and Sonar) costs more CPU
than most of the worlds it joins. A pool worker starts once, then runs rank after rank:

    python -m tests.models.rank_pool

reads jobs from stdin, one JSON line each (``{"module": ..., "argv": [...]}``), calls that rank
module's ``cli(argv)`` (the module's own command line, which joins a world, computes and leaves
it) and answers one JSON line on its original stdout: ``{"ok": true}`` or the error. A worker whose
rank failed exits after answering (its group's state is unknown); the pool starts another for the
next world. Everything else the ranks print goes to stderr, a file per worker that a failure quotes.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
#: Imported once when a worker starts, before its first job: what every rank module needs.
WARM = ("torch", "torch.distributed", "sonar.engine.ranks", "sonar.models.loader", "tests.models.parallel_rank")


class _Worker:
    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="rank-pool-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.models.rank_pool"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def stderr_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def end(self) -> None:
        """No more jobs: the worker returns from its loop and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    @property
    def alive(self) -> bool:
        return not self.log.closed and self.proc.poll() is None

    def close(self) -> None:
        if self.log.closed:
            return
        self.end()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


class RankPool:
    """Worker processes, started as a world first needs them and kept for the next one."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []

    def world(self, module: str, size: int, args: list[str]) -> None:
        """`size` ranks of `module`, rank ``r`` running ``cli([PORT, r, *args])``, on a gloo world whose
        store this process holds at 127.0.0.1:PORT."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False)
        self.run(module, [[str(store.port), str(rank), *args] for rank in range(size)])

    def run(self, module: str, argvs: list[list[str]], timeout: float = 300) -> None:
        """Rank ``i`` runs ``module.cli(argvs[i])`` in worker ``i``, all at once; returns when every
        rank succeeded and fails with the first failure's error (and its worker's stderr) otherwise."""
        for i in range(len(argvs)):
            if i == len(self._workers):
                self._workers.append(_Worker())
            elif not self._workers[i].alive:  # its last rank failed
                self._workers[i].close()
                self._workers[i] = _Worker()
        workers = self._workers[: len(argvs)]
        for worker, argv in zip(workers, argvs):
            assert worker.proc.stdin is not None
            worker.proc.stdin.write(json.dumps({"module": module, "argv": argv}) + "\n")
            worker.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        errors = []
        for rank, worker in enumerate(workers):
            reply = _reply(worker.proc.stdout, deadline)
            if reply is None:
                for stuck in self._workers:  # a rank that hangs holds its world's others: start afresh
                    stuck.proc.kill()
                self.close()
                raise AssertionError(f"rank {rank} of {module} did not finish in {timeout} s")
            if not reply.get("ok"):
                errors.append(f"rank {rank}: {reply.get('error', 'exited')}\n{worker.stderr_tail()}")
                worker.close()  # it exits after a failure: the next world starts another
        assert not errors, "\n".join(errors)

    def close(self) -> None:
        for worker in self._workers:  # all at once: each exit takes seconds (torch's teardown)
            worker.end()
        for worker in self._workers:
            worker.close()
        self._workers = []


def _reply(stream: IO[str] | None, deadline: float) -> dict | None:
    """The worker's answer to its job; ``{}`` where it exited without one, None past `deadline`."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return None
    line = stream.readline()
    return json.loads(line) if line else {}


def serve() -> None:
    """A worker's loop (see the module docstring)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a rank's own output, Python's or a library's, must not mix into the replies
    sys.stdout = sys.stderr
    for name in WARM:
        importlib.import_module(name)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            importlib.import_module(job["module"]).cli(job["argv"])
        except BaseException:
            replies.write(json.dumps({"ok": False, "error": traceback.format_exc()}) + "\n")
            return
        _release_memory()
        replies.write(json.dumps({"ok": True}) + "\n")


def _release_memory() -> None:
    """Hand the rank's freed model weights back to the system: an idle worker waits for the next
    world holding little more than its imports."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: its allocator keeps what it keeps
        pass


if __name__ == "__main__":
    serve()
