"""The processes of a parallel group (tensor x pipeline): where each sits, how they meet, what they
pass between stages, and their CPU cores.

World rank ``r`` runs pipeline stage ``r // tp`` as tensor-parallel rank ``r % tp`` of that stage's
group (Megatron's order). Rank 0 (stage 0) takes the scheduler's steps; the *sampler*, tensor rank 0
of the last stage, which alone has the logits, samples, shares the sampled ids with every rank and
hands the step's result back to rank 0.

Every incarnation of a group meets anew: its leader (rank 0) opens a `TCPStore` on a port the
system picks and tells the other ranks where it is (`JoinGroup`, over Sonar's own transport), so a
group rebuilt after a crash never meets a stale store. On one machine the store and gloo's pair
sockets listen on the loopback interface only. Over several nodes (`sonar.engine.nodes`) the store
is the head's, at ``--master-addr:--master-port`` for the head's lifetime, and each incarnation
meets under a key prefix of its own there instead (`connect_store`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sonar.actors.spec import OWN_GPU_ENV
from sonar.engine import cores
from sonar.log import get_logger
from sonar.models.parallel import SINGLE, WHOLE, PipelineStage, TensorParallel

log = get_logger("sonar.ranks")

LOOPBACK = "127.0.0.1"


def _timeout(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def open_store(host: str, size: int, timeout: float | None) -> dist.TCPStore:
    """The leader's rendezvous store, on a port the system picks (`store.port`)."""
    kwargs = {} if timeout is None else {"timeout": _timeout(timeout)}
    return dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False, **kwargs)


def connect_store(host: str, port: int, prefix: str, timeout: float | None) -> dist.Store:
    """The store at host:port as a client, its keys under `prefix` (one incarnation's)."""
    kwargs = {} if timeout is None else {"timeout": _timeout(timeout)}
    store = dist.TCPStore(host, port, is_master=False, **kwargs)
    return dist.PrefixStore(prefix, store) if prefix else store


@dataclass(frozen=True)
class Topology:
    """This process's place among the world's ranks, and what passes between them."""

    rank: int = 0
    tp: TensorParallel = SINGLE
    stage: PipelineStage = WHOLE
    device: str = "cpu"

    @property
    def size(self) -> int:
        return self.tp.size * self.stage.size

    @property
    def sampler(self) -> int:
        """The world rank that samples: tensor rank 0 of the last stage."""
        return (self.stage.size - 1) * self.tp.size

    @property
    def samples(self) -> bool:
        return self.rank == self.sampler

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The sampler's `tokens` (int64: the sampled ids of the step's rows, and whether each row
        failed), on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(tokens, src=self.sampler)
        return tokens

    def send_hidden(self, *tensors: torch.Tensor) -> None:
        """To the next stage's rank of the same tensor rank: this stage's output and residual
        (and what else the next stage must have: EAGLE-3's captured states)."""
        dst = self.rank + self.tp.size
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=dst)

    def recv_hidden(self, rows: int, width: int, dtype: torch.dtype, count: int = 2) -> tuple[torch.Tensor, ...]:
        """From the previous stage: its output and residual (and ``count - 2`` more), ``[rows, width]`` each."""
        src = self.rank - self.tp.size
        tensors = tuple(torch.empty(rows, width, dtype=dtype, device=self.device) for _ in range(count))
        for tensor in tensors:
            dist.recv(tensor, src=src)
        return tensors


SOLO = Topology()


def join(
    store: dist.TCPStore | None,
    host: str,
    port: int,
    rank: int,
    tp_size: int,
    pp_size: int,
    device: torch.device,
    timeout: float | None,
    layer_counts: tuple[int, ...] | None = None,
    prefix: str = "",
) -> Topology:
    """Join the world whose store listens at host:port (`store`: rank 0's own; `prefix`: this
    incarnation's keys in a store that outlives it) as `rank`: NCCL on CUDA, gloo on the CPU; then
    every stage's tensor-parallel group (each rank takes part in making all of them).
    `layer_counts`: layers per stage, else an even partition."""
    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    size = tp_size * pp_size
    if store is None:
        store = connect_store(host, port, prefix, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_timeout(timeout))
    log.info("ranks.rendezvous", rank=rank, backend=backend, rendezvous=f"{host}:{port}")
    return groups(rank, tp_size, pp_size, device, layer_counts)


def launched_store(rank: int, size: int, timeout: float | None, prefix: str) -> dist.Store:
    """The rendezvous store of the world torchrun (or another external launcher) set up in this
    process's environment (``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), its keys under
    `prefix`: the launcher's store outlives a world (torchrun's agent holds it), so a process that
    joins again never meets the keys of its world before."""
    kwargs = {} if timeout is None else {"timeout": _timeout(timeout)}
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=size, **kwargs))
    return dist.PrefixStore(prefix, store)


def join_launched(
    store: dist.Store, rank: int, tp_size: int, pp_size: int, device: torch.device, timeout: float | None
) -> Topology:
    """Join the launcher's world (`launched_store`) as `rank`: NCCL on CUDA, gloo on the CPU; then
    every stage's tensor-parallel group, as `join`."""
    if _is_loopback(os.environ.get("MASTER_ADDR", "")):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    size = tp_size * pp_size
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=_timeout(timeout))
    counts = layer_counts_from_env(os.environ.get("SONAR_PP_LAYER_PARTITION"))
    return groups(rank, tp_size, pp_size, device, counts)


def groups(
    rank: int, tp_size: int, pp_size: int, device: torch.device, layer_counts: tuple[int, ...] | None
) -> Topology:
    """After the world is joined: every stage's tensor-parallel group (each rank takes part in
    making all of them), and this rank's place."""
    stage, tp_rank = divmod(rank, tp_size)
    group = None  # one stage: its group is the world
    if pp_size > 1 and tp_size > 1:
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        group = groups[stage]
    log.info("ranks.joined", rank=rank, tp=tp_size, pp=pp_size, stage=stage)
    return Topology(
        rank=rank,
        tp=TensorParallel(rank=tp_rank, size=tp_size, group=group),
        stage=PipelineStage(index=stage, size=pp_size, counts=layer_counts),
        device=str(device),
    )


def layer_counts_from_env(value: str | None) -> tuple[int, ...] | None:
    """``SONAR_PP_LAYER_PARTITION`` (layers per stage, comma-separated) as counts, or None."""
    if not value:
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"SONAR_PP_LAYER_PARTITION={value!r}: expected layer counts such as 8,8,7,7") from None


def leave() -> None:
    """Wait for every rank, then tear down this process's group (a process that ends on purpose;
    a crashed one just exits)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The CUDA device of `rank`: the rank-th from the one chosen for rank 0 (NCCL takes one
    rank per GPU). A process that Ray gave a GPU of its own (``SONAR_OWN_GPU``, set by
    `sonar.actors.ray_runner`) sees that one alone, as device 0."""
    if os.environ.get(OWN_GPU_ENV):
        return torch.device("cuda", 0)
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"tensor-parallel rank {rank} needs CUDA device {index}, but torch sees {torch.cuda.device_count()}: "
            "one GPU per rank"
        )
    return torch.device("cuda", index)


def pin_to_cores(rank: int, size: int) -> list[int]:
    """Bind this process to rank `rank` of `size`'s share of the cores it may run on (its
    replica's, with data parallelism)."""
    return cores.share_of_mine(rank, size)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
