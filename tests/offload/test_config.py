"""The offload flags: every documented form parses, every invalid one names its rule."""

import json

import pytest

from sonar.offload.config import (
    GIB,
    KVEventsConfig,
    kv_events_config_from_flags,
    offload_config_from_flags,
)


def parse(transfer=None, size=None, backend="native", block_size=16):
    return offload_config_from_flags(
        primary_block_size=block_size,
        kv_offloading_size=size,
        kv_offloading_backend=backend,
        kv_transfer_config=transfer,
    )


def extra(**kw):
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": kw}


def test_off_by_default():
    assert parse() is None
    assert kv_events_config_from_flags(None) is None
    assert kv_events_config_from_flags('{"enable_kv_cache_events": false}') is None


def test_kv_offloading_size_gives_a_cpu_tier():
    cfg = parse(size=1.5)
    assert cfg.spec_name == "CPUOffloadingSpec"
    assert [(t.medium, t.size_bytes) for t in cfg.tiers] == [("cpu", int(1.5 * GIB))]
    assert cfg.blocks_per_chunk == 1 and cfg.eviction_policy == "lru"


def test_lmcache_backend_is_not_supported_yet():
    with pytest.raises(ValueError, match="'lmcache' is not supported yet"):
        parse(size=1, backend="lmcache")
    with pytest.raises(ValueError, match="must be one of native, lmcache"):
        parse(size=1, backend="magic")


@pytest.mark.parametrize("size", [0, -1, "2", True])
def test_size_must_be_positive(size):
    with pytest.raises(ValueError, match="--kv-offloading-size must be a positive number of GiB"):
        parse(size=size)


def test_transfer_config_as_json_string_and_dict():
    text = json.dumps(extra(spec_name="CPUOffloadingSpec", cpu_bytes_to_use=1 << 20))
    assert parse(text) == parse(json.loads(text))
    cfg = parse(text)
    assert cfg.tiers[0].size_bytes == 1 << 20


def test_tiering_spec_has_cpu_then_disk(tmp_path):
    cfg = parse(
        extra(
            spec_name="TieringOffloadingSpec",
            cpu_size_gib=0.5,
            disk_path=str(tmp_path),
            disk_size_gib=2,
            eviction_policy="arc",
        )
    )
    assert [(t.medium, t.size_bytes, t.path) for t in cfg.tiers] == [
        ("cpu", GIB // 2, None),
        ("disk", 2 * GIB, str(tmp_path)),
    ]
    assert cfg.eviction_policy == "arc" and cfg.disk.path == str(tmp_path)
    assert cfg.disk.fsync  # on unless turned off
    off = parse(extra(spec_name="TieringOffloadingSpec", disk_path=str(tmp_path), disk_size_gib=2, disk_fsync=False))
    assert not off.disk.fsync


@pytest.mark.parametrize(
    ("kw", "bpc"), [({}, 1), ({"block_size": 16}, 1), ({"block_size": 64}, 4), ({"blocks_per_chunk": 2}, 2)]
)
def test_chunk_size(kw, bpc):
    assert parse(extra(**kw)).blocks_per_chunk == bpc


@pytest.mark.parametrize(
    ("transfer", "rule"),
    [
        (extra(block_size=16, blocks_per_chunk=1), "block_size and blocks_per_chunk are mutually exclusive"),
        (extra(block_size=24), r"block_size \(24\) must be a multiple of the KV cache block size \(16\)"),
        (extra(block_size=0), r"block_size must be a positive integer \(> 0\)"),
        (extra(blocks_per_chunk=0), r"blocks_per_chunk must be a positive integer \(> 0\)"),
        (extra(blocks_per_chunk=1.5), r"blocks_per_chunk must be a positive integer"),
        (extra(spec_name="GPUSpec"), "spec_name must be one of CPUOffloadingSpec, TieringOffloadingSpec"),
        (extra(eviction_policy="fifo"), "eviction_policy must be one of lru, arc"),
        (
            extra(spec_name="TieringOffloadingSpec", disk_size_gib=1),
            "TieringOffloadingSpec needs kv_connector_extra_config.disk_path",
        ),
        (extra(spec_name="TieringOffloadingSpec", disk_path="/tmp/x"), "needs kv_connector_extra_config.disk_size_gib"),
        (extra(disk_path="/tmp/x"), "disk_path needs spec_name 'TieringOffloadingSpec'"),
        (extra(disk_fsync=False), "disk_fsync needs spec_name 'TieringOffloadingSpec'"),
        (
            extra(spec_name="TieringOffloadingSpec", disk_path="/tmp/x", disk_size_gib=1, disk_fsync="yes"),
            "disk_fsync must be true or false",
        ),
        (extra(cpu_bytes_to_use=1, cpu_size_gib=1), "cpu_bytes_to_use and cpu_size_gib are mutually exclusive"),
        (extra(colour="blue"), r"unknown key\(s\) colour"),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "kv_connector must be 'OffloadingConnector'"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}, "kv_role must be 'kv_both'"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": [1]}, "must be a JSON object"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_invalid_transfer_configs_name_the_rule(transfer, rule):
    with pytest.raises(ValueError, match=rule):
        parse(transfer)


def test_size_and_transfer_config_are_exclusive():
    with pytest.raises(ValueError, match="mutually exclusive"):
        parse(extra(), size=1)


def test_kv_events_config():
    cfg = kv_events_config_from_flags(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558",
                "topic": "kv",
                "buffer_steps": 10000,
            }
        )
    )
    assert cfg == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        topic="kv",
        buffer_steps=10000,
    )
    # enabling alone means publishing over zmq at the default endpoint: loopback only (the events
    # carry prompt token ids), replay rate-limited, no CURVE
    default = kv_events_config_from_flags({"enable_kv_cache_events": True})
    assert default.publisher == "zmq" and default.endpoint == "tcp://127.0.0.1:5557"
    assert (default.replay_rate_limit, default.replay_burst) == (2.0, 10)
    assert default.curve_secret_key_file is None


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps must be positive"),
        ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint must be a ZMQ address"),
        ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://127.0.0.1:5557"}, "replay_endpoint must differ"),
        ({"enable_kv_cache_events": True, "replay_rate_limit": 0}, "replay_rate_limit must be positive"),
        ({"enable_kv_cache_events": True, "replay_burst": 0}, "replay_burst at least 1"),
        ({"enable_kv_cache_events": True, "curve_secret_key_file": "/k/pub.key_secret"}, "go together"),
        ({"enable_kv_cache_events": True, "curve_authorized_keys_dir": "/k/clients"}, "go together"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "--kv-events-config"),
        ({"enable_kv_cache_events": True, "bogus": 1}, "unknown field"),
    ],
)
def test_invalid_kv_events_configs(value, rule):
    with pytest.raises(ValueError, match=rule):
        kv_events_config_from_flags(value)
