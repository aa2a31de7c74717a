"""`python -m sonar bench actors`: what one message costs in each placement.

Measures ask() round trips (median, p99) and messages per second for fire-and-forget sends,
in-process and cross-process, and the throughput of a 64 MiB tensor sent across processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Union

import anyio
import msgspec

from sonar.actors import Actor, Ask, ChildSpec, SupervisorSpec, parse_placement, supervise


class BenchPing(Ask, tag=True):
    reply_type = int


class BenchNote(msgspec.Struct, tag=True):
    value: int


class BenchCount(Ask, tag=True):
    reply_type = int


class BenchTensor(Ask, tag=True):
    tensor: Any
    reply_type = int


BenchMsg = Union[BenchPing, BenchNote, BenchCount, BenchTensor]


class BenchActor(Actor):
    protocol = BenchMsg

    def __init__(self) -> None:
        self.count = 0

    async def handle(self, msg: BenchMsg) -> Any:
        if isinstance(msg, BenchPing):
            return 0
        if isinstance(msg, BenchNote):
            self.count += 1
            return None
        if isinstance(msg, BenchCount):
            return self.count
        if isinstance(msg, BenchTensor):
            return msg.tensor.numel() * msg.tensor.element_size()
        raise TypeError(msg)


async def _measure(placement: str, asks: int, sends: int, tensor_mib: int, repeats: int) -> dict[str, Any]:
    spec = SupervisorSpec(
        "bench", [ChildSpec("b", BenchActor, placement=parse_placement(placement), ping_interval=None)]
    )
    out: dict[str, Any] = {"placement": placement}
    async with supervise(spec) as sup:
        ref = sup.child("b").ref
        for _ in range(min(asks, 200)):  # warm up
            await ref.ask(BenchPing())
        lat = []
        for _ in range(asks):
            t0 = time.perf_counter_ns()
            await ref.ask(BenchPing())
            lat.append((time.perf_counter_ns() - t0) / 1000)
        lat.sort()
        out["ask_median_us"] = statistics.median(lat)
        out["ask_p99_us"] = lat[int(len(lat) * 0.99) - 1]
        out["asks_per_s"] = len(lat) / (sum(lat) / 1e6)
        t0 = time.perf_counter()
        for i in range(sends):
            await ref.send(BenchNote(i))
        assert await ref.ask(BenchCount()) == sends
        out["sends_per_s"] = sends / (time.perf_counter() - t0)
        if tensor_mib:
            import torch

            t = torch.randn(tensor_mib * 2**20 // 4)
            nbytes = t.numel() * 4
            assert await ref.ask(BenchTensor(t)) == nbytes
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                await ref.ask(BenchTensor(t))
                best = min(best, time.perf_counter() - t0)
            out["tensor_mib"] = tensor_mib
            out["tensor_gb_per_s"] = nbytes / best / 1e9
    return out


_ZMQ_ECHO = """
import sys, zmq
ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.bind(sys.argv[1])
while True:
    frames = sock.recv_multipart()
    if frames[1] == b"quit":
        break
    sock.send_multipart(frames)
"""


def zmq_floor(asks: int) -> float:
    """Median round trip of bare blocking pyzmq DEALER→ROUTER→DEALER between two processes (µs):
    the floor under any cross-process ask, measured in the same run for a ratio."""
    import os
    import subprocess
    import sys
    import tempfile

    import zmq

    address = f"ipc://{tempfile.gettempdir()}/sonar-bench-{os.getpid()}.sock"
    server = subprocess.Popen([sys.executable, "-c", _ZMQ_ECHO, address])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    try:
        lat = []
        for i in range(asks + min(asks, 200)):
            t0 = time.perf_counter_ns()
            sock.send(b"x")
            sock.recv()
            if i >= min(asks, 200):
                lat.append((time.perf_counter_ns() - t0) / 1000)
        sock.send(b"quit")
        server.wait(timeout=10)
        return statistics.median(lat)
    finally:
        sock.close(linger=0)
        ctx.term()
        if server.poll() is None:
            server.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sonar bench actors", description=__doc__)
    ap.add_argument("--placements", default="inprocess,process", help="comma-separated placements")
    ap.add_argument("--asks", type=int, default=5000)
    ap.add_argument("--sends", type=int, default=20000)
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object per placement")
    args = ap.parse_args(argv)
    floor = zmq_floor(args.asks)
    rows = []
    for placement in args.placements.split(","):
        rows.append(
            anyio.run(_measure, placement, args.asks, args.sends, args.tensor_mib, args.repeats, backend="asyncio")
        )
    if args.json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
        print(msgspec.json.encode({"zmq_floor_round_trip_us": floor}).decode())
        return 0
    print(f"{'placement':<12} {'ask p50 µs':>11} {'ask p99 µs':>11} {'asks/s':>9} {'sends/s':>9} {'tensor GB/s':>12}")
    for r in rows:
        in_process = r["placement"] == "inprocess"  # the receiver gets the sender's own tensor
        gbs = f"{r['tensor_gb_per_s']:.2f}" if "tensor_gb_per_s" in r and not in_process else "-"
        print(
            f"{r['placement']:<12} {r['ask_median_us']:>11.1f} {r['ask_p99_us']:>11.1f} {r['asks_per_s']:>9.0f} "
            f"{r['sends_per_s']:>9.0f} {gbs:>12}"
        )
    print(f"bare pyzmq round trip between two processes (blocking, no codec): {floor:.1f} µs median")
    return 0
