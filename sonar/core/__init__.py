"""Pure cores of the engine: KV blocks, prefix cache, requests and the scheduling policy.

Nothing here does I/O or touches an event loop; the actor shells in ``sonar.engine`` call
these with plain values.
"""

from sonar.core.blocks import BlockManager
from sonar.core.outputs import RequestUpdate, ScheduledRequest, SchedulerOutput, SchedulerStats
from sonar.core.prefix import HASH_ALGOS, PrefixHasher
from sonar.core.request import (
    DuplicateRequestError,
    PromptTooLongError,
    Request,
    RequestRejectedError,
    RequestStatus,
)
from sonar.core.schedule import Scheduler, SchedulerConfig

__all__ = [
    "BlockManager",
    "DuplicateRequestError",
    "HASH_ALGOS",
    "PrefixHasher",
    "PromptTooLongError",
    "Request",
    "RequestRejectedError",
    "RequestStatus",
    "RequestUpdate",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
]
