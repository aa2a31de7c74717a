"""The KV offload manager: second-tier KV pools (CPU, disk) keyed by prefix-cache block hashes.

``config`` parses the flags, ``layout`` names what a chunk is, ``transfer`` moves chunks in and
out of the primary cache (the worker's side), ``tiers`` / ``disk`` / ``policy`` hold the pools,
``manager`` is the actor, ``events`` the KV events publisher; the messages are
``sonar.protocol.offload``. See ``docs/kv_offload.md``.
"""

from sonar.offload.config import (
    KVEventsConfig,
    OffloadConfig,
    TierConfig,
    kv_events_config_from_flags,
    offload_config_from_flags,
)
from sonar.offload.layout import KV_FORMAT_VERSION, KVLayout
from sonar.offload.transfer import gather_chunks, scatter_chunks
from sonar.protocol.offload import ChunkMeta

__all__ = [
    "KV_FORMAT_VERSION",
    "ChunkMeta",
    "KVEventsConfig",
    "KVLayout",
    "OffloadConfig",
    "TierConfig",
    "gather_chunks",
    "kv_events_config_from_flags",
    "offload_config_from_flags",
    "scatter_chunks",
]
