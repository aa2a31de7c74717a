"""The processes of a tensor-parallel group: their torch.distributed rendezvous and their CPU cores.

Every incarnation of a group meets anew: its leader (rank 0) opens a `TCPStore` on a port the
system picks and tells the other ranks where it is (`JoinGroup`, over Sonar's own transport), so a
group rebuilt after a crash never meets a stale store. On one machine the store and gloo's pair
sockets listen on the loopback interface only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

import torch
import torch.distributed as dist

from sonar.log import get_logger
from sonar.models.parallel import TensorParallel

log = get_logger("sonar.ranks")

LOOPBACK = "127.0.0.1"


def _timeout(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def open_store(host: str, size: int, timeout: float | None) -> dist.TCPStore:
    """The leader's rendezvous store, on a port the system picks (`store.port`)."""
    kwargs = {} if timeout is None else {"timeout": _timeout(timeout)}
    return dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, **kwargs)


def join(
    store: dist.TCPStore | None,
    host: str,
    port: int,
    rank: int,
    size: int,
    device: torch.device,
    timeout: float | None,
) -> TensorParallel:
    """Join the group whose store listens at host:port (`store`: the leader's own), as `rank`:
    NCCL on CUDA, gloo on the CPU. Returns this process's `TensorParallel`."""
    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if store is None:
        kwargs = {} if timeout is None else {"timeout": _timeout(timeout)}
        store = dist.TCPStore(host, port, size, is_master=False, **kwargs)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_timeout(timeout))
    log.info("tp.joined", rank=rank, size=size, backend=backend, rendezvous=f"{host}:{port}")
    return TensorParallel(rank=rank, size=size, device=str(device))


def leave() -> None:
    """Tear down this process's group (a stopping rank; a crashed one just exits)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The CUDA device of `rank`: the rank-th from the one chosen for rank 0."""
    return torch.device("cuda", (device.index or 0) + rank)


def core_share(rank: int, size: int, cores: list[int]) -> list[int]:
    """The CPU cores of `rank` in a group of `size` sharing `cores`: every size-th core from its
    rank, or (more ranks than cores) one core, shared with the ranks that wrap onto it."""
    own = cores[rank::size]
    return own or [cores[rank % len(cores)]]


def pin_to_cores(rank: int, size: int) -> list[int]:
    """Pin this process (and torch's thread pool) to its share of the cores it may run on."""
    cores = core_share(rank, size, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
