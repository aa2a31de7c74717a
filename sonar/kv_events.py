"""KV cache events over ZMQ: the publisher, its replay endpoint, and a reference consumer.

Wire format (``docs/kv_offload.md`` has the full story):

* The publisher's PUB socket sends one three-frame message per batch:
  ``[topic, seq, payload]``: ``topic`` the configured topic (bytes, may be empty), ``seq`` the
  batch's sequence number as an 8-byte big-endian signed integer (0, 1, 2, ... per publisher
  run), ``payload`` a msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``, each
  event an array whose first element names it: ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, extra_keys]``, ``["BlockRemoved", block_hashes,
  medium]``, ``["AllBlocksCleared", medium]``.
* The ROUTER replay socket takes a request whose last frame is an 8-byte big-endian start
  sequence number and answers, for every batch still in its ring buffer (``buffer_steps`` of
  them) from that number on, ``[b"", seq, payload]``, then the end marker ``[b"", seq=-1, b""]``.

A consumer keeps, per medium, a reference count per block hash: each ``BlockStored`` listing a
hash adds one, each ``BlockRemoved`` takes one, removals of unknown hashes are ignored, and
``AllBlocksCleared`` empties the medium (all media when it names none). Overlapping chunks and
re-announcements are then harmless. ``KVBlockIndex`` is that rule; ``KVEventConsumer`` feeds it
from the sockets (replay first, then live, filling gaps from the replay endpoint).

    python -m sonar.kv_events consume tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence

import msgspec
import zmq

from sonar.core.events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from sonar.log import get_logger
from sonar.offload.config import KVEventsConfig

__all__ = [
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVBlockIndex", "KVEvent", "KVEventBatch",
    "KVEventConsumer", "KVEventPublisher", "END_OF_REPLAY",
]

log = get_logger("sonar.kv_events")

END_OF_REPLAY = -1
_STOP = object()


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def _seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class KVEventPublisher:
    """Publishes event batches from any thread; one background thread owns the sockets.

    ``publish(events)`` queues a batch (blocking only when ``max_queue_size`` batches wait); the
    thread numbers it, sends it on the PUB socket and keeps it for replay. Addresses are bound;
    a ``tcp://host:*`` address binds a free port (``endpoint`` / ``replay_endpoint`` then hold the
    real one).
    """

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.rank = data_parallel_rank
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self.next_seq = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sonar-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def publish(self, events: Sequence[KVEvent]) -> None:
        if events:
            self._queue.put((time.time(), list(events)))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets and end the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = router = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(self.replay_endpoint)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = ValueError(f"--kv-events-config: cannot bind {exc}")
            for s in (pub, router):
                if s is not None:
                    s.close(0)
            self._ready.set()
            return
        self._ready.set()
        try:
            running = True
            while running:
                try:
                    item = self._queue.get(timeout=0.005 if router is not None else 0.05)
                except queue.Empty:
                    item = None
                while item is not None:
                    if item is _STOP:
                        running = False
                        break
                    self._send(pub, *item)
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                if router is not None:
                    while router.poll(0):
                        self._replay(router, router.recv_multipart())
        except Exception as exc:  # a publisher failure must not pass silently
            log.error("kv_events.publisher_failed", error=str(exc))
            raise
        finally:
            pub.close()
            if router is not None:
                router.close(0)

    def _send(self, pub: zmq.Socket, ts: float, events: list[KVEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(ts, events, self.rank))
        seq = self.next_seq
        self.next_seq += 1
        pub.send_multipart([self.topic, _seq_bytes(seq), payload], copy=False)
        self._buffer.append((seq, payload))

    def _replay(self, router: zmq.Socket, frames: list[bytes]) -> None:
        identity, start_frame = frames[0], frames[-1]
        if len(start_frame) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            start = self.next_seq  # nothing to resend; still answer with the end marker
        else:
            start = _seq_of(start_frame)
        for seq, payload in list(self._buffer):
            if seq >= start:
                router.send_multipart([identity, b"", _seq_bytes(seq), payload])
        router.send_multipart([identity, b"", _seq_bytes(END_OF_REPLAY), b""])


class KVBlockIndex:
    """Which blocks each medium holds, from announcements (reference-counted per hash)."""

    def __init__(self) -> None:
        self.refs: dict[str, dict[bytes, int]] = {m: {} for m in MEDIUMS}
        self.ignored_removals = 0
        self.events = 0

    def apply(self, event: KVEvent) -> None:
        self.events += 1
        if isinstance(event, BlockStored):
            refs = self.refs.setdefault(event.medium, {})
            for h in event.block_hashes:
                refs[h] = refs.get(h, 0) + 1
        elif isinstance(event, BlockRemoved):
            refs = self.refs.setdefault(event.medium, {})
            for h in event.block_hashes:
                n = refs.get(h)
                if n is None:
                    self.ignored_removals += 1
                elif n <= 1:
                    del refs[h]
                else:
                    refs[h] = n - 1
        elif isinstance(event, AllBlocksCleared):
            for medium, refs in self.refs.items():
                if event.medium is None or event.medium == medium:
                    refs.clear()

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def blocks(self, medium: str) -> set[bytes]:
        return set(self.refs.get(medium, {}))

    def has(self, block_hash: bytes, medium: str | None = None) -> bool:
        media = self.refs.values() if medium is None else [self.refs.get(medium, {})]
        return any(block_hash in refs for refs in media)

    def summary(self) -> dict[str, int]:
        return {m: len(refs) for m, refs in self.refs.items()}


class KVEventConsumer:
    """Subscribes to a publisher and keeps a ``KVBlockIndex`` (synchronous; one thread)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 index: KVBlockIndex | None = None) -> None:
        self.index = index or KVBlockIndex()
        self.last_seq = -1
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.batches = 0
        self.gaps = 0

    def close(self) -> None:
        self._sub.close(0)

    def __enter__(self) -> "KVEventConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _apply(self, seq: int, payload: bytes) -> list[tuple[int, KVEvent]]:
        if seq <= self.last_seq:
            return []  # already seen (a replay overlapping the live stream)
        batch = self._decoder.decode(payload)
        self.index.apply_all(batch.events)
        self.last_seq = seq
        self.batches += 1
        return [(seq, event) for event in batch.events]

    def replay(self, from_seq: int = 0, timeout: float = 5.0) -> list[tuple[int, KVEvent]]:
        """Fetch and apply every buffered batch from ``from_seq`` on (batches already applied are
        skipped); returns the new events with their batch's sequence number."""
        if self.replay_endpoint is None:
            raise ValueError("no replay endpoint to replay from")
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, KVEvent]] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", _seq_bytes(from_seq)])
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    raise TimeoutError(f"no end of replay from {self.replay_endpoint} within {timeout} s")
                frames = dealer.recv_multipart()
                seq = _seq_of(frames[-2])
                if seq == END_OF_REPLAY:
                    return out
                out += self._apply(seq, frames[-1])
        finally:
            dealer.close(0)

    def poll(self, timeout: float = 0.1) -> list[tuple[int, KVEvent]]:
        """Apply the live batches that arrive within ``timeout`` seconds (at least one waited for);
        a gap in the sequence numbers is filled from the replay endpoint first."""
        out: list[tuple[int, KVEvent]] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            _topic, seq_frame, payload = self._sub.recv_multipart()
            seq = _seq_of(seq_frame)
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                self.gaps += 1
                out += self.replay(self.last_seq + 1)
            out += self._apply(seq, payload)
        return out


def event_to_json(event: KVEvent, seq: int) -> str:
    """One event as a JSON line: ``{"seq": N, "event": ["BlockStored", [hex hashes], ...]}``."""
    return json.dumps({"seq": seq, "event": _hexify(msgspec.to_builtins(event, builtin_types=(bytes,)))})


def _hexify(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_hexify(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sonar.kv_events", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    consume = sub.add_parser("consume", help="print events as JSON lines and keep a block index")
    consume.add_argument("endpoint", help="the publisher's PUB address, e.g. tcp://127.0.0.1:5557")
    consume.add_argument("--replay", dest="replay_endpoint", help="the replay (ROUTER) address")
    consume.add_argument("--topic", default="")
    consume.add_argument("--from-seq", type=int, default=0, help="replay from this sequence number first")
    consume.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    args = parser.parse_args(argv)
    with KVEventConsumer(args.endpoint, args.replay_endpoint, topic=args.topic) as consumer:
        if args.replay_endpoint:
            for seq, event in consumer.replay(args.from_seq):
                print(event_to_json(event, seq), flush=True)
        end = None if args.duration is None else time.monotonic() + args.duration
        try:
            while end is None or time.monotonic() < end:
                for seq, event in consumer.poll(0.2):
                    print(event_to_json(event, seq), flush=True)
        except KeyboardInterrupt:
            pass
        print(json.dumps({"summary": consumer.index.summary(), "last_seq": consumer.last_seq,
                          "ignored_removals": consumer.index.ignored_removals}), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
