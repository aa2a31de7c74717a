"""The disk tier's safety on real directories and a real full filesystem: a private directory
(created 0700, refused when another user owns it or others may write to it), private chunk files
written to a temporary name, fsync'ed, then renamed; a full disk degrades the tier to memory (the
CPU tier goes on, the chunks already on disk are still served) and writes resume once there is
room again.

The full disk is a 256 KiB tmpfs mounted for the test when this process may mount (root), else a
file size limit (``RLIMIT_FSIZE``) in a child process: the kernel then fails the write with EFBIG
instead of ENOSPC, and the tier takes the same path."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import pytest
import torch

from sonar.offload import disk as disk_module
from sonar.offload.disk import SUFFIX, TMP_PREFIX, UnsafeDirectoryError, secure_directory
from sonar.offload.tiers import DiskTier, TieredStore
from tests.offload.helpers import config, layout, sequence, tiny_tmpfs

ROOT = Path(__file__).resolve().parents[2]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the directory ----------------------------------------------------------------------------------
def test_a_missing_directory_is_created_private(tmp_path):
    root = tmp_path / "a" / "b" / "kv"
    store = TieredStore(layout(), config(layout(), 4, disk=str(root), disk_chunks=4))
    assert root.is_dir() and mode_of(root) == 0o700
    hashes, metas, data = sequence(layout(), 2)
    store.store(metas, data)
    files = sorted(root.iterdir())
    assert [f.name for f in files] == sorted(m.key.hex() + SUFFIX for m in metas)
    assert all(mode_of(f) == 0o600 for f in files)


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777, 0o720, 0o702])
def test_a_directory_others_may_write_to_is_refused(tmp_path, mode):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafeDirectoryError, match=rf"writable by its group or others \(mode {mode:04o}\).*chmod 700"):
        TieredStore(layout(), config(layout(), 4, disk=str(root), disk_chunks=4))
    assert list(root.iterdir()) == []


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:
        root = tmp_path / "kv"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)  # nobody
    else:
        root = Path("/")  # root's, and this process is not root
    with pytest.raises(UnsafeDirectoryError, match=rf"belongs to uid {root.stat().st_uid}, not to this process"):
        secure_directory(root)


def test_a_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "kv"
    path.write_bytes(b"")
    with pytest.raises((UnsafeDirectoryError, FileExistsError)):
        secure_directory(path)


def test_a_directory_others_may_read_works_with_a_warning(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o755)
    warnings: list[str] = []
    monkeypatch.setattr("sonar.offload.tiers.log.warning", lambda event, **fields: warnings.append(event))
    DiskTier(layout(), root, 1 << 20)
    assert warnings == ["offload.disk.readable_by_others"] and mode_of(root) == 0o755  # not changed behind one's back


def test_symlinked_chunk_files_are_not_followed(tmp_path):
    root = tmp_path / "kv"
    store = TieredStore(layout(), config(layout(), 4, disk=str(root), disk_chunks=4))
    hashes, metas, data = sequence(layout(), 1)
    store.store(metas, data)
    target = tmp_path / "elsewhere"
    (root / (metas[0].key.hex() + SUFFIX)).rename(target)
    (root / (metas[0].key.hex() + SUFFIX)).symlink_to(target)
    again = TieredStore(layout(), config(layout(), 4, disk=str(root), disk_chunks=4))
    assert again.lookup(hashes) == (0, [])  # a symlink is never indexed, so never served


# -- writing a chunk --------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", [True, False])
def test_chunks_are_written_to_a_temporary_name_synced_then_renamed(tmp_path, monkeypatch, fsync):
    synced: list[tuple[str, int, bool]] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        synced.append((Path(path).name, os.fstat(fd).st_size, Path(path).exists()))
        real_fsync(fd)

    monkeypatch.setattr(disk_module.os, "fsync", recording_fsync)
    lay = layout()
    cfg = config(lay, 4, disk=str(tmp_path / "kv"), disk_chunks=4)
    cfg = msgspec.structs.replace(cfg, tiers=[cfg.tiers[0], msgspec.structs.replace(cfg.tiers[1], fsync=fsync)])
    store = TieredStore(lay, cfg)
    _, metas, data = sequence(lay, 2)
    store.store(metas, data)
    final = {p.name: p.stat().st_size for p in (tmp_path / "kv").iterdir()}
    assert sorted(final) == sorted(m.key.hex() + SUFFIX for m in metas)
    if fsync:  # each file synced whole, under its temporary name (which then existed), before the rename
        assert sorted((n.split("-")[1] + SUFFIX, size, existed) for n, size, existed in synced) == sorted(
            (name, size, True) for name, size in final.items()
        )
        assert all(n.startswith(TMP_PREFIX) for n, _, _ in synced)
    else:
        assert synced == []


# -- a full disk ------------------------------------------------------------------------------------
def _big_layout():
    return layout(head_dim=256)  # 32 KiB chunks


def full_disk_scenario(root: str, fill: Callable[[], None], make_room: Callable[[], None]) -> dict[str, Any]:
    """Store chunks, fill the disk, store more, make room, store again; what the tier did at each
    point (JSON-able, so a child process can report it)."""
    from sonar.offload import tiers

    logged: list[str] = []

    class Log:
        def __getattr__(self, level: str) -> Callable[..., None]:
            return lambda event, **fields: logged.append(f"{level} {event}")

    real_log, tiers.log = tiers.log, Log()
    try:
        return _full_disk_scenario(root, fill, make_room, logged)
    finally:
        tiers.log = real_log


def _full_disk_scenario(
    root: str, fill: Callable[[], None], make_room: Callable[[], None], logged: list[str]
) -> dict[str, Any]:
    lay = _big_layout()
    events: list[Any] = []
    store = TieredStore(lay, config(lay, cpu_chunks=16, disk=root, disk_chunks=64), events.extend)
    store.disk.RETRY_AFTER = 0.3
    hashes, metas, data = sequence(lay, 8)
    out: dict[str, Any] = {}
    store.store(metas[:2], data[:2])
    out["before"] = {"files": len(list(Path(root).glob("*" + SUFFIX))), "stats": _disk_stats(store)}
    fill()
    store.store(metas[2:5], data[2:5])  # the first write fails; the next two are not tried
    held = store.lookup(hashes[:5])
    first, chunks, mediums = store.load(hashes[:5])
    out["full"] = {
        "stats": _disk_stats(store),
        "log": list(logged),
        "lookup": held[1],
        "load": mediums,
        "same_data": all(torch.equal(c, d) for c, d in zip(chunks, data[:5])),
        "tmp_files": [p.name for p in Path(root).iterdir() if p.name.startswith(TMP_PREFIX)],
        "files": len(list(Path(root).glob("*" + SUFFIX))),
        "disk_events": sum(1 for e in events if type(e).__name__ == "BlockStored" and e.medium == "DISK"),
    }
    store.clear(disk=False)  # the CPU tier empty: what is on disk is still served
    out["disk_still_read"] = store.load(hashes[:2])[2]
    make_room()
    store.store(metas[5:6], data[5:6])  # still inside the pause: not tried
    paused = _disk_stats(store)
    time.sleep(0.4)
    store.store(metas[6:8], data[6:8])  # the pause is over: written again
    out["recovered"] = {
        "paused": paused,
        "stats": _disk_stats(store),
        "log": list(logged),
        "on_disk": [m.key.hex() + SUFFIX in {p.name for p in Path(root).iterdir()} for m in metas],
    }
    return out


def _disk_stats(store: TieredStore) -> dict[str, Any]:
    s = store.disk.stats
    return {"write_errors": s.write_errors, "degraded": s.degraded, "stores": s.stores, "chunks": s.chunks}


def _run_with_file_size_limit(root: Path) -> dict[str, Any]:
    code = f"""
import json, resource, signal
from tests.offload.test_disk_safety import full_disk_scenario
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the limit: EFBIG, not death
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
def fill(): resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
def make_room(): resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print(json.dumps(full_disk_scenario({str(root)!r}, fill, make_room)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_full_disk_degrades_the_tier_to_memory_and_recovers(tmp_path):
    with tiny_tmpfs() as mount:
        if mount is not None:  # ENOSPC for real
            root = mount / "kv"
            filler = mount / "filler"

            def fill() -> None:
                with open(filler, "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC

            out = full_disk_scenario(str(root), fill, lambda: filler.unlink())
        else:  # EFBIG from the file size limit, in a child process
            out = _run_with_file_size_limit(tmp_path / "kv")
    assert out["before"] == {"files": 2, "stats": {"write_errors": 0, "degraded": False, "stores": 2, "chunks": 2}}
    full = out["full"]
    assert full["stats"] == {"write_errors": 1, "degraded": True, "stores": 2, "chunks": 2}
    assert full["log"] == ["info offload.disk.indexed", "warning offload.disk.degraded"]  # once
    assert full["lookup"] == full["load"] == ["CPU"] * 5 and full["same_data"]  # still served, from memory
    assert full["tmp_files"] == [] and full["files"] == 2 and full["disk_events"] == 2
    assert out["disk_still_read"] == ["DISK", "DISK"]
    recovered = out["recovered"]
    assert recovered["paused"]["degraded"] and recovered["paused"]["write_errors"] == 1
    assert recovered["stats"] == {"write_errors": 1, "degraded": False, "stores": 4, "chunks": 4}
    assert recovered["log"] == full["log"] + ["info offload.disk.recovered"]
    assert recovered["on_disk"] == [True, True, False, False, False, False, True, True]


def test_the_file_size_limit_path_also_works(tmp_path):
    """The fallback of the test above, run here too so that both paths stay green."""
    out = _run_with_file_size_limit(tmp_path / "kv")
    assert out["full"]["stats"]["degraded"] and out["full"]["lookup"] == ["CPU"] * 5
    assert out["recovered"]["stats"]["degraded"] is False and out["recovered"]["on_disk"][6:] == [True, True]
