"""The worker actor: a thin shell around the `ModelRunner` of one device (`sonar/engine/runner.py`).

Loading and forward passes run in a thread so the mailbox loop stays responsive while a step
computes.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import msgspec

from sonar.actors import Actor
from sonar.engine.config import EngineConfig
from sonar.engine.protocol import DescribeWorker, ExecuteStep, WorkerMsg
from sonar.engine.runner import ModelRunner


class WorkerActor(Actor):
    protocol = WorkerMsg

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = msgspec.convert(config, EngineConfig)

    async def started(self) -> None:
        self.runner = await anyio.to_thread.run_sync(ModelRunner, self.config)

    async def handle(self, msg: WorkerMsg) -> Any:
        if isinstance(msg, ExecuteStep):
            return await anyio.to_thread.run_sync(self.runner.execute, msg)
        if isinstance(msg, DescribeWorker):
            return self.runner.info
        raise TypeError(f"unexpected {type(msg).__name__}")
