"""The KV offload manager: second-tier KV pools (CPU, disk) keyed by prefix-cache block hashes.

``config`` parses the flags, ``layout`` names what a chunk is, ``transfer`` moves chunks in and
out of the primary cache (the worker's side), ``tiers`` / ``disk`` / ``policy`` hold the pools,
``manager`` is the actor, ``events`` the KV events publisher; the messages are
``sonar.protocol.offload``. See ``docs/kv_offload.md``.

The names below are imported on first use: the flags' parser reads ``config`` without
importing torch (the layout's) on the way.
"""

from __future__ import annotations

from sonar.lazy import lazy_exports

_EXPORTS = {
    "KV_FORMAT_VERSION": "sonar.offload.layout",
    "ChunkMeta": "sonar.protocol.offload",
    "KVEventsConfig": "sonar.offload.config",
    "KVLayout": "sonar.offload.layout",
    "OffloadConfig": "sonar.offload.config",
    "TierConfig": "sonar.offload.config",
    "gather_chunks": "sonar.offload.transfer",
    "kv_events_config_from_flags": "sonar.offload.config",
    "offload_config_from_flags": "sonar.offload.config",
    "scatter_chunks": "sonar.offload.transfer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
