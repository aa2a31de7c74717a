"""KV offloading and KV events through the real server (`python -m sonar serve`), no mocks.

* CPU tier (`--kv-offloading-size`) behind a deliberately tiny primary cache: a prefix evicted
  from the primary cache is served from the CPU tier, with the same output as when it was
  computed, `usage.prompt_tokens_details.cached_tokens` counting the loaded tokens, and the tier
  metrics saying so. KV events over real ZMQ: the reference consumer sees `BlockStored` for GPU
  and CPU, `BlockRemoved`, and a replay from a sequence number resends what followed it.
* Disk tier (`TieringOffloadingSpec`): a restarted server reuses a prefix stored before it
  stopped; a chunk file with flipped bytes (under that server) is detected, dropped, logged and
  never served; a full
  disk degrades the tier (logged, in the metrics) while every request is still served.
* Invalid `--kv-transfer-config` values stop the server at startup with exit code 2 and one line
  naming the rule.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sonar.core.events import BlockRemoved, BlockStored
from sonar.offload.events import KVEventConsumer
from tests.http.conftest import ROOT, ServerProcess, free_port, serving, tls
from tests.offload.helpers import tiny_tmpfs

BLOCK = 16
COMMON = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "40",
    "--seed",
    "0",
    "--enable-prompt-tokens-details",
    "--max-num-seqs",
    "4",
)


def _prompt(k: int) -> str:
    """A distinct ~400-token prompt: two of them cannot both stay in 40 primary blocks."""
    return f"Inventory {k}: " + ", ".join(f"item{(i * 7 + k * 13) % 997} x{i % 9 + 1}" for i in range(70))


def _complete(server: ServerProcess, prompt: str) -> dict[str, Any]:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=120,
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30, verify=tls()).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(sonar:[\w:]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _wait_for(server: ServerProcess, key: str, at_least: float, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = _metrics(server)
        if metrics.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            assert metrics.get(key, 0.0) >= at_least, f"{key} stayed at {metrics.get(key)}"
            return metrics
        time.sleep(0.2)


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path


def _cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cpu_tier_serves_an_evicted_prefix_and_publishes_events(tmp_path: Path) -> None:
    pub, replay = free_port(), free_port()
    events = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv",
        }
    )
    with serving(tmp_path, *COMMON, "--kv-offloading-size", "0.25", "--kv-events-config", events) as server:
        assert "KV offloading: CPUOffloadingSpec: CPU 0.25 GiB" in server.out()
        with KVEventConsumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv") as consumer:
            first = _complete(server, _prompt(0))
            prompt_tokens = first["usage"]["prompt_tokens"]
            reusable = (prompt_tokens - 1) // BLOCK * BLOCK
            _wait_for(server, 'sonar:kv_offload_chunks{medium="CPU"}', reusable // BLOCK)
            for k in (1, 3):  # evict prompt 0's blocks from the 40-block primary cache
                _complete(server, _prompt(k))
            again = _complete(server, _prompt(0))
            metrics = _metrics(server)
            seen = consumer.replay(0)
            seen += consumer.poll(0.5)
        mid = seen[len(seen) // 2][0]
        with KVEventConsumer(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", topic="kv") as late:
            replayed = late.replay(mid)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert _cached(first) == 0
    assert _cached(again) == reusable
    assert metrics['sonar:kv_offload_hit_blocks_total{medium="CPU"}'] == reusable // BLOCK
    assert metrics['sonar:kv_offload_loads_total{medium="CPU"}'] == reusable // BLOCK
    assert metrics["sonar:external_prefix_cache_hits_total"] == reusable
    assert metrics['sonar:kv_offload_load_latency_seconds_count{medium="CPU"}'] == 1
    assert metrics["sonar:num_requests_waiting_for_kv"] == 0

    stored = {e.medium for _, e in seen if isinstance(e, BlockStored)}
    assert {"GPU", "CPU"} <= stored
    assert any(isinstance(e, BlockRemoved) and e.medium == "GPU" for _, e in seen)
    first_gpu = next(e for _, e in seen if isinstance(e, BlockStored) and e.medium == "GPU")
    assert first_gpu.parent_block_hash is None and first_gpu.block_size == BLOCK
    assert len(first_gpu.token_ids) == len(first_gpu.block_hashes) * BLOCK
    seqs = [seq for seq, _ in seen]
    assert seqs == sorted(seqs) and seqs[0] == 0 and len(set(seqs)) == seqs[-1] + 1  # no gap
    # A consumer replaying from a mid-stream sequence number gets exactly the batches from it on.
    assert replayed[0][0] == mid
    assert [x for x in replayed if x[0] <= seqs[-1]] == [x for x in seen if x[0] >= mid]


def test_disk_tier_survives_a_restart_and_a_corrupt_chunk_is_never_served(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    transfer = json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_size_gib": 0.25,
                "disk_path": str(disk),
                "disk_size_gib": 1,
            },
        }
    )
    args = (*COMMON, "--kv-transfer-config", transfer)
    prompt, other = _prompt(2), _prompt(4)
    with serving(_fresh(tmp_path / "a"), *args) as server:
        first = _complete(server, prompt)
        reusable = (first["usage"]["prompt_tokens"] - 1) // BLOCK
        _wait_for(server, 'sonar:kv_offload_chunks{medium="DISK"}', reusable)
        files = set(disk.glob("*.kvchunk"))
        other_first = _complete(server, other)
        other_reusable = (other_first["usage"]["prompt_tokens"] - 1) // BLOCK
        _wait_for(server, 'sonar:kv_offload_chunks{medium="DISK"}', reusable + other_reusable)
    assert len(files) == reusable
    other_files = set(disk.glob("*.kvchunk")) - files
    assert len(other_files) == other_reusable

    # One restart shows both: the first prompt's chunks are reused; the other's, corrupted under
    # the running server, are detected on read and never served.
    with serving(_fresh(tmp_path / "b"), *args) as server:
        again = _complete(server, prompt)
        metrics = _metrics(server)
        # Flip bytes in the middle of each of the other prompt's chunk files' payload.
        for path in other_files:
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            path.write_bytes(bytes(raw))
        third = _complete(server, other)
        after = _metrics(server)
        log = server.log()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert _cached(again) == reusable * BLOCK
    assert metrics['sonar:kv_offload_hit_blocks_total{medium="DISK"}'] == reusable
    assert metrics.get('sonar:kv_offload_corrupt_chunks_total{medium="DISK"}', 0.0) == 0

    assert third["choices"][0]["text"] == other_first["choices"][0]["text"]  # recomputed, not served
    assert _cached(third) == 0
    assert after['sonar:kv_offload_corrupt_chunks_total{medium="DISK"}'] == 1  # the load stops at the first
    assert after['sonar:kv_offload_hit_blocks_total{medium="DISK"}'] == reusable  # none of the other's
    assert "offload.disk.corrupt" in log and "digest mismatch" in log


def test_a_full_disk_degrades_the_tier_and_requests_keep_being_served(tmp_path: Path) -> None:
    """The disk tier on a 2 MiB tmpfs (room for two chunk files of this model): the third write
    fails with ENOSPC, the tier degrades (a warning, `sonar:kv_offload_degraded{medium="DISK"} 1`,
    the failed write counted), and every request is still answered, with the CPU tier serving
    prefixes. Where this process may not mount, the directory is made read-only under the running
    server instead (EACCES; root ignores that, hence the tmpfs)."""
    with tiny_tmpfs("2m") as mount:
        disk = (mount or tmp_path) / "kv"
        transfer = json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec",
                    "cpu_size_gib": 0.25,
                    "disk_path": str(disk),
                    "disk_size_gib": 1,
                },
            }
        )
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
        with serving(
            _fresh(tmp_path / "server"), *COMMON, "--kv-transfer-config", transfer, "--kv-events-config", events
        ) as server:
            assert stat.S_IMODE(disk.stat().st_mode) == 0o700
            if mount is None:
                disk.chmod(0o500)
            first = [_complete(server, _prompt(k)) for k in range(2)]
            _wait_for(server, 'sonar:kv_offload_degraded{medium="DISK"}', 1)
            again = _complete(server, _prompt(0))  # part of it was evicted from the 40 primary blocks
            metrics = _metrics(server)
            log = server.log()
            if mount is None:
                disk.chmod(0o700)
            assert not list(disk.glob(".tmp-*"))  # a failed write leaves nothing behind
    assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
    assert metrics['sonar:kv_offload_hit_blocks_total{medium="CPU"}'] > 0  # the CPU tier goes on
    assert metrics['sonar:kv_offload_write_errors_total{medium="DISK"}'] >= 1
    assert metrics['sonar:kv_offload_degraded{medium="CPU"}'] == 0
    assert (
        metrics['sonar:kv_offload_stores_total{medium="CPU"}'] > metrics['sonar:kv_offload_stores_total{medium="DISK"}']
    )
    assert metrics["sonar:kv_events_dropped_total"] == 0
    assert "offload.disk.degraded" in log and ("ENOSPC" in log or "EACCES" in log)


@pytest.mark.parametrize(
    "value, rule",
    [
        (
            '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"block_size": 32, "blocks_per_chunk": 2}}',
            "block_size and blocks_per_chunk are mutually exclusive",
        ),
        (
            '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"block_size": 24}}',
            "must be a multiple of the KV cache block size (16)",
        ),
        (
            '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"blocks_per_chunk": 0}}',
            "blocks_per_chunk must be a positive integer",
        ),
        (
            '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec"}}',
            "TieringOffloadingSpec needs kv_connector_extra_config.disk_path",
        ),
        ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "kv_connector must be 'OffloadingConnector'"),
    ],
)
def test_invalid_transfer_config_fails_at_startup(value: str, rule: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sonar", "serve", "--kv-transfer-config", value],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sonar serve: error: ") and rule in lines[0], proc.stderr
