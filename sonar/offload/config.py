"""The offload and KV-event flags, parsed into typed structs.

Three flags feed the offload manager:

* ``--kv-offloading-size GiB`` with ``--kv-offloading-backend native``: a CPU tier of that size
  (the short form; equivalent to a ``CPUOffloadingSpec`` transfer config).
* ``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {...}}'``: the long form, which can also ask for
  ``TieringOffloadingSpec`` (CPU, then a disk directory).
* ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``.

``offload_config_from_flags`` and ``kv_events_config_from_flags`` turn the raw flag values (a JSON
string, a dict, or None) into ``OffloadConfig`` / ``KVEventsConfig``; every invalid value or
combination raises ``ValueError`` naming the rule it breaks. Nothing here touches a device or a
file: the disk directory is created by the disk tier when the manager starts.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

__all__ = [
    "DEFAULT_CPU_TIER_GIB",
    "KVEventsConfig",
    "OffloadConfig",
    "TierConfig",
    "kv_events_config_from_flags",
    "offload_config_from_flags",
]

GIB = 2**30
CONNECTOR = "OffloadingConnector"
SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")
BACKENDS_SUPPORTED = ("native",)
BACKENDS_KNOWN = ("native", "lmcache")
ROLES_SUPPORTED = ("kv_both",)
EVICTION_POLICIES = ("lru", "arc")
DEFAULT_CPU_TIER_GIB = 4.0
"""CPU tier size when a transfer config names a spec but no size."""


class TierConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One second-tier pool: ``cpu`` (a preallocated tensor pool) or ``disk`` (a directory)."""

    medium: Literal["cpu", "disk"]
    size_bytes: int
    path: str | None = None
    """The directory of a disk tier (created 0700 on start); None for the CPU tier."""
    fsync: bool = True
    """Disk tier: flush each chunk file to the disk before renaming it into place."""


class OffloadConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the offload manager runs: its tiers (first = fastest), chunking and eviction."""

    spec_name: str
    tiers: list[TierConfig]
    blocks_per_chunk: int = 1
    """Primary (GPU) blocks per offloaded chunk; resolved from ``block_size`` when given."""
    eviction_policy: Literal["lru", "arc"] = "lru"
    io_threads: int = 2
    """Threads that run tier I/O beside the manager's mailbox loop."""

    @property
    def cpu_bytes(self) -> int:
        return sum(t.size_bytes for t in self.tiers if t.medium == "cpu")

    @property
    def disk(self) -> TierConfig | None:
        return next((t for t in self.tiers if t.medium == "disk"), None)


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``--kv-events-config``: where and how KV cache events are published.

    The events carry the token ids of every cached prompt, so the default endpoint listens on the
    loopback interface only; another interface is the operator's choice (``tcp://*:5557``), logged
    as a warning unless CURVE authentication is configured (``curve_secret_key_file``).
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://127.0.0.1:5557"
    """The address the PUB socket binds (loopback; ``tcp://*:5557`` binds every interface)."""
    replay_endpoint: str | None = None
    """The ROUTER socket that resends buffered batches from a sequence number; None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """ZMQ send high-water mark of the PUB socket (messages)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; further batches are dropped (and counted), never
    waited for: publishing must not stall the engine."""
    topic: str = ""
    replay_rate_limit: float = 2.0
    """Replay requests per second each requester (peer address) may make, on average."""
    replay_burst: int = 10
    """Replay requests a requester may make at once before ``replay_rate_limit`` applies."""
    curve_secret_key_file: str | None = None
    """A ZMQ certificate file with the publisher's CURVE key pair (``python -m sonar.offload.events
    keygen``): both sockets then encrypt and only accept the keys in ``curve_authorized_keys_dir``."""
    curve_authorized_keys_dir: str | None = None
    """A directory of the subscribers' public certificates (``*.key``); required with CURVE."""

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _as_dict(value: Any, flag: str) -> dict[str, Any] | None:
    if value is None or value == "":
        return None
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if isinstance(value, msgspec.Struct):
        value = msgspec.to_builtins(value)
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {type(value).__name__}")
    return value


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"kv_connector_extra_config.{name} must be a positive integer (> 0), got {value!r}")
    return value


def _size_bytes(value: Any, name: str) -> int:
    """A tier size in GiB (int or float) -> bytes; must be > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
    return int(value * GIB)


def offload_config_from_flags(
    *,
    primary_block_size: int,
    kv_offloading_size: float | None = None,
    kv_offloading_backend: str = "native",
    kv_transfer_config: Any = None,
) -> OffloadConfig | None:
    """The offload config the flags ask for, or None when offloading is off.

    ``primary_block_size`` is the engine's KV block size in tokens (``--block-size``): an
    offloaded chunk is a whole number of primary blocks.
    """
    transfer = _as_dict(kv_transfer_config, "--kv-transfer-config")
    if kv_offloading_backend not in BACKENDS_KNOWN:
        raise ValueError(
            f"--kv-offloading-backend must be one of {', '.join(BACKENDS_KNOWN)}, got {kv_offloading_backend!r}"
        )
    if kv_offloading_size is not None:
        if transfer is not None:
            raise ValueError(
                "--kv-offloading-size and --kv-transfer-config are mutually exclusive: "
                "give the CPU tier size in one place only"
            )
        if kv_offloading_backend not in BACKENDS_SUPPORTED:
            raise ValueError(f"--kv-offloading-backend {kv_offloading_backend!r} is not supported yet; use 'native'")
        size = _size_bytes(kv_offloading_size, "--kv-offloading-size")
        return OffloadConfig(spec_name="CPUOffloadingSpec", tiers=[TierConfig(medium="cpu", size_bytes=size)])
    if transfer is None:
        return None
    return _from_transfer_config(transfer, primary_block_size)


_TRANSFER_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_buffer_device", "engine_id"}
_EXTRA_KEYS = {
    "spec_name",
    "block_size",
    "blocks_per_chunk",
    "eviction_policy",
    "cpu_bytes_to_use",
    "cpu_size_gib",
    "disk_path",
    "disk_size_gib",
    "disk_fsync",
    "io_threads",
    "spec_module_path",
}


def _from_transfer_config(transfer: dict[str, Any], primary_block_size: int) -> OffloadConfig:
    unknown = sorted(set(transfer) - _TRANSFER_KEYS)
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)}")
    connector = transfer.get("kv_connector")
    if connector != CONNECTOR:
        raise ValueError(
            f"--kv-transfer-config: kv_connector must be {CONNECTOR!r} (the only connector Sonar has), "
            f"got {connector!r}"
        )
    role = transfer.get("kv_role", "kv_both")
    if role not in ROLES_SUPPORTED:
        raise ValueError(f"--kv-transfer-config: kv_role must be 'kv_both' for the {CONNECTOR}, got {role!r}")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(extra) - _EXTRA_KEYS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}")
    if extra.get("spec_module_path") not in (None, "", "sonar.offload"):
        raise ValueError("kv_connector_extra_config.spec_module_path: custom offloading specs are not supported yet")
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if spec not in SPECS:
        raise ValueError(f"kv_connector_extra_config.spec_name must be one of {', '.join(SPECS)}, got {spec!r}")

    if "block_size" in extra and "blocks_per_chunk" in extra:
        raise ValueError("kv_connector_extra_config: block_size and blocks_per_chunk are mutually exclusive; give one")
    if "block_size" in extra:
        tokens = _positive_int(extra["block_size"], "block_size")
        if tokens % primary_block_size:
            raise ValueError(
                f"kv_connector_extra_config.block_size ({tokens}) must be a multiple of the KV cache "
                f"block size ({primary_block_size})"
            )
        blocks_per_chunk = tokens // primary_block_size
    elif "blocks_per_chunk" in extra:
        blocks_per_chunk = _positive_int(extra["blocks_per_chunk"], "blocks_per_chunk")
    else:
        blocks_per_chunk = 1

    policy = extra.get("eviction_policy", "lru")
    if policy not in EVICTION_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config.eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}"
        )
    if "cpu_bytes_to_use" in extra and "cpu_size_gib" in extra:
        raise ValueError("kv_connector_extra_config: cpu_bytes_to_use and cpu_size_gib are mutually exclusive")
    if "cpu_bytes_to_use" in extra:
        cpu_bytes = _positive_int(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
    elif "cpu_size_gib" in extra:
        cpu_bytes = _size_bytes(extra["cpu_size_gib"], "kv_connector_extra_config.cpu_size_gib")
    else:
        cpu_bytes = int(DEFAULT_CPU_TIER_GIB * GIB)
    tiers = [TierConfig(medium="cpu", size_bytes=cpu_bytes)]

    disk_keys = {"disk_path", "disk_size_gib", "disk_fsync"} & set(extra)
    if spec == "TieringOffloadingSpec":
        path = extra.get("disk_path")
        if not isinstance(path, str) or not path:
            raise ValueError("TieringOffloadingSpec needs kv_connector_extra_config.disk_path (a directory)")
        if "disk_size_gib" not in extra:
            raise ValueError(
                "TieringOffloadingSpec needs kv_connector_extra_config.disk_size_gib (the disk tier limit)"
            )
        disk_bytes = _size_bytes(extra["disk_size_gib"], "kv_connector_extra_config.disk_size_gib")
        fsync = extra.get("disk_fsync", True)
        if not isinstance(fsync, bool):
            raise ValueError(f"kv_connector_extra_config.disk_fsync must be true or false, got {fsync!r}")
        tiers.append(TierConfig(medium="disk", size_bytes=disk_bytes, path=path, fsync=fsync))
    elif disk_keys:
        raise ValueError(
            f"kv_connector_extra_config.{sorted(disk_keys)[0]} needs spec_name 'TieringOffloadingSpec' "
            "(CPUOffloadingSpec has no disk tier)"
        )
    io_threads = _positive_int(extra.get("io_threads", 2), "io_threads")
    return OffloadConfig(
        spec_name=spec,
        tiers=tiers,
        blocks_per_chunk=blocks_per_chunk,
        eviction_policy=policy,
        io_threads=io_threads,
    )


def kv_events_config_from_flags(value: Any) -> KVEventsConfig | None:
    """``--kv-events-config`` as a struct; None when events are off."""
    raw = _as_dict(value, "--kv-events-config")
    if raw is None:
        return None
    try:
        config = msgspec.convert(raw, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None
    if config.enable_kv_cache_events and config.publisher == "null":
        # The flag alone means "publish"; like the reference server, zmq is what publishing uses.
        config = msgspec.structs.replace(config, publisher="zmq")
    if config.buffer_steps <= 0:
        raise ValueError(f"--kv-events-config: buffer_steps must be positive, got {config.buffer_steps}")
    if config.hwm < 0 or config.max_queue_size <= 0:
        raise ValueError("--kv-events-config: hwm must be >= 0 and max_queue_size positive")
    if not config.replay_rate_limit > 0 or config.replay_burst < 1:
        raise ValueError(
            "--kv-events-config: replay_rate_limit must be positive and replay_burst at least 1, "
            f"got {config.replay_rate_limit} and {config.replay_burst}"
        )
    if (config.curve_secret_key_file is None) != (config.curve_authorized_keys_dir is None):
        raise ValueError(
            "--kv-events-config: curve_secret_key_file and curve_authorized_keys_dir go together "
            "(the publisher's key pair, and the subscribers' public keys it accepts)"
        )
    if config.active:
        for name in ("endpoint", "replay_endpoint"):
            address = getattr(config, name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {name} must be a ZMQ address (tcp://, ipc://), got {address!r}")
        if config.replay_endpoint is not None and config.replay_endpoint == config.endpoint:
            raise ValueError("--kv-events-config: replay_endpoint must differ from endpoint")
    return config if config.active else None
