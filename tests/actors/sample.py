"""Actors used by the runtime tests; importable by child processes (`tests.actors.sample`)."""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any, Union

import anyio
import msgspec

from sonar.actors import Actor, ActorRef, Ask


class Echo(Ask, tag=True):
    text: str
    reply_type = str


class Add(Ask, tag=True):
    """Append `value` to the actor's list; the reply is the list so far."""

    value: int
    reply_type = list[int]


class Note(msgspec.Struct, tag=True):
    """Fire-and-forget: append `value` (slowly, when the actor was built with a delay)."""

    value: int
    pad: bytes = b""


class Notes(Ask, tag=True):
    reply_type = list[int]


class Crash(msgspec.Struct, tag=True):
    """Raise inside `handle` (the actor crashes)."""


class FailAsk(Ask, tag=True):
    """Raise inside `handle` while answering an ask."""


class Hang(msgspec.Struct, tag=True):
    """Block the mailbox loop forever (an await that never returns)."""


class Freeze(msgspec.Struct, tag=True):
    """Block the whole event loop (a synchronous call that never returns)."""


class Quit(msgspec.Struct, tag=True):
    """Exit normally from inside."""


class Tensors(Ask, tag=True):
    """Return a checksum of every tensor and array received, and echo the first one back."""

    tensors: list[Any]
    reply_type = dict[str, Any]


class Whoami(Ask, tag=True):
    reply_type = dict[str, Any]


class HeapState(Ask, tag=True):
    """Whether the process collects garbage, and how many objects its start froze."""

    reply_type = dict[str, Any]


class AskPeers(Ask, tag=True):
    """Ask each of the actor's `peers` `Whoami`; the answers, in order."""

    reply_type = list[dict[str, Any]]


SampleMsg = Union[Echo, Add, Note, Notes, Crash, FailAsk, Hang, Freeze, Quit, Tensors, Whoami, HeapState, AskPeers]


class Other(msgspec.Struct, tag=True):
    """A message outside SampleMsg."""


class Sample(Actor):
    protocol = SampleMsg

    def __init__(
        self,
        delay: float = 0.0,
        ignore_stop: bool = False,
        ignore_sigterm: bool = False,
        fail_start: bool = False,
        start_delay: float = 0.0,
        peers: list[ActorRef] | None = None,
        greet_peers: bool = False,
    ) -> None:
        self.values: list[int] = []
        self.peers = peers or []
        self.delay = delay
        self.ignore_stop = ignore_stop
        self.ignore_sigterm = ignore_sigterm
        self.fail_start = fail_start
        self.start_delay = start_delay
        self.greet_peers = greet_peers

    async def started(self) -> None:
        if self.greet_peers:  # the start fails unless every peer answers
            for peer in self.peers:
                await peer.ask(Whoami(), timeout=10)
        if self.fail_start:
            raise RuntimeError("refusing to start")
        if self.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.start_delay:
            await anyio.sleep(self.start_delay)

    async def stopping(self) -> None:
        if self.ignore_stop:
            await anyio.sleep_forever()

    async def handle(self, msg: SampleMsg) -> Any:
        if isinstance(msg, Echo):
            return msg.text
        if isinstance(msg, (Add, Note)):
            if self.delay:
                await anyio.sleep(self.delay)
            self.values.append(msg.value)
            return list(self.values)
        if isinstance(msg, Notes):
            return list(self.values)
        if isinstance(msg, (Crash, FailAsk)):
            raise RuntimeError(f"{self.name} was told to crash")
        if isinstance(msg, Hang):
            await anyio.sleep_forever()
        if isinstance(msg, Freeze):
            while True:
                time.sleep(3600)
        if isinstance(msg, Quit):
            self.exit()
        if isinstance(msg, Tensors):
            import torch

            sums = []
            for t in msg.tensors:
                if isinstance(t, torch.Tensor):
                    sums.append(float(t.double().sum()))
                else:
                    sums.append(float(t.astype("float64").sum()))
            first = msg.tensors[0] if msg.tensors else None
            return {"sums": sums, "first": first}
        if isinstance(msg, Whoami):
            return {"pid": os.getpid(), "name": self.name}
        if isinstance(msg, HeapState):
            return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
        if isinstance(msg, AskPeers):
            return [await peer.ask(Whoami(), timeout=10) for peer in self.peers]
        raise TypeError(msg)


class Touch(Actor):
    """Creates the file `path` when built: proof on disk that a host ran it (it is on no allow-list)."""

    protocol = SampleMsg

    def __init__(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("spawned\n")
