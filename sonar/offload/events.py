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
  A requester over its rate limit gets only the end marker, with ``b"rate limited"`` as payload.

A consumer keeps, per medium, a reference count per block hash (``sonar.core.kv_index.KVBlockIndex``
states the rule); ``KVEventConsumer`` feeds one from the sockets (replay first, then live, filling
gaps from the replay endpoint).

The events carry prompt token ids: the publisher binds loopback by default, warns when it binds
another interface without CURVE, and with CURVE (``keygen`` writes key pairs) accepts only the
subscribers whose public keys it was given.

    python -m sonar.offload.events consume tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558
    python -m sonar.offload.events keygen /etc/sonar/kv-keys publisher
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.auth

from sonar.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from sonar.core.kv_index import KVBlockIndex
from sonar.errors import SonarError
from sonar.log import get_logger
from sonar.offload.config import KVEventsConfig

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventConsumer",
    "KVEventPublisher",
    "END_OF_REPLAY",
    "REPLAY_REFUSED",
    "RateLimiter",
    "ReplayRefusedError",
    "is_loopback",
]

log = get_logger("sonar.kv_events")

END_OF_REPLAY = -1
REPLAY_REFUSED = b"rate limited"
"""The payload of the end marker that answers a refused replay request."""
_STOP = object()


def _power_of_two(n: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th, ... occurrence of a repeated warning."""
    return n & (n - 1) == 0


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def _seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class ReplayRefusedError(SonarError, RuntimeError):
    """The replay endpoint refused a request (the requester exceeded its rate limit)."""


class RateLimiter:
    """A token bucket per requester: ``rate`` requests per second on average, ``burst`` at once.

    Remembers the ``max_requesters`` most recent requesters (a forgotten one starts again with a
    full bucket), so a flood of new peers cannot grow it without bound.
    """

    def __init__(
        self, rate: float, burst: int, *, max_requesters: int = 1024, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.max_requesters = max_requesters
        self.clock = clock
        self._buckets: dict[object, tuple[float, float]] = {}

    def allow(self, requester: object) -> bool:
        now = self.clock()
        tokens, last = self._buckets.pop(requester, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[requester] = (tokens - 1.0 if allowed else tokens, now)  # most recent last
        if len(self._buckets) > self.max_requesters:
            del self._buckets[next(iter(self._buckets))]
        return allowed


def is_loopback(endpoint: str) -> bool:
    """Whether a ZMQ address can only be reached from this machine (ipc, inproc, loopback tcp)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name
        return False


class KVEventPublisher:
    """Publishes event batches from any thread; one background thread owns the sockets.

    ``publish(events)`` numbers the batch and queues it without ever waiting: when
    ``max_queue_size`` batches already wait (the thread is stalled), the batch is dropped and
    counted (``dropped``), and its sequence number stays unused, so consumers see the gap. The
    thread sends each batch on the PUB socket (which drops, per subscriber, what a slow subscriber
    has not taken beyond ``hwm``) and keeps it for replay. Replay requests are rate-limited per
    requester (``replay_rate_limit``, ``replay_burst``); a refused one is answered with the end
    marker carrying ``b"rate limited"``. Addresses are bound; a ``tcp://host:*`` address binds a
    free port (``endpoint`` / ``replay_endpoint`` then hold the real one). With
    ``curve_secret_key_file`` both sockets use CURVE and accept only the authorized keys.
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
        self._lock = threading.Lock()
        self.next_seq = 0
        """The sequence number of the next batch published."""
        self.sent = 0
        """Batches sent on the PUB socket."""
        self.dropped = 0
        """Batches dropped because the publisher thread had ``max_queue_size`` waiting."""
        self.replays_refused = 0
        self._limiter = RateLimiter(config.replay_rate_limit, config.replay_burst)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sonar-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue a batch; never blocks (a batch that finds the queue full is dropped, counted)."""
        if not events:
            return
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            try:
                self._queue.put_nowait((seq, time.time(), list(events)))
                return
            except queue.Full:
                self.dropped += 1
                dropped = self.dropped
        if _power_of_two(dropped):
            log.warning("kv_events.dropped", seq=seq, dropped_total=dropped, queue=self.config.max_queue_size)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets and end the thread."""
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout)  # after what is queued
            except queue.Full:
                log.warning("kv_events.close_timeout", queued=self._queue.qsize())
                return
            self._thread.join(timeout)

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None, Any]:
        """Bind the sockets (with CURVE when configured); the authenticator thread, if any."""
        config = self.config
        auth = None
        sockets: list[zmq.Socket] = []
        try:
            keys = None
            if config.curve_secret_key_file is not None:
                from zmq.auth.thread import ThreadAuthenticator

                public, secret = zmq.auth.load_certificate(config.curve_secret_key_file)
                if secret is None:
                    raise ValueError(f"{config.curve_secret_key_file} holds no secret key")
                if not os.path.isdir(config.curve_authorized_keys_dir or ""):
                    raise ValueError(
                        f"curve_authorized_keys_dir {config.curve_authorized_keys_dir!r} is not a directory"
                    )
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("sonar.kv_events.auth"))
                auth.start()
                auth.configure_curve(domain="*", location=config.curve_authorized_keys_dir)
                keys = (public, secret)

            def bind(kind: int, address: str, hwm: int, linger: int) -> tuple[zmq.Socket, str]:
                sock = ctx.socket(kind)
                sockets.append(sock)
                # Options first: a connection accepted later takes them from the bound listener.
                sock.setsockopt(zmq.SNDHWM, hwm)
                sock.setsockopt(zmq.LINGER, linger)
                if keys is not None:
                    sock.curve_publickey, sock.curve_secretkey = keys
                    sock.curve_server = True
                sock.bind(address)
                return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

            pub, self.endpoint = bind(zmq.PUB, self.endpoint, config.hwm, 1000)
            router = None
            if self.replay_endpoint is not None:
                # A whole replay fits in a peer's queue (ROUTER drops beyond it); the payloads are
                # sent zero-copy, so queued replays share the ring buffer's bytes.
                router, self.replay_endpoint = bind(zmq.ROUTER, self.replay_endpoint, config.buffer_steps + 1, 0)
        except (zmq.ZMQError, OSError, ValueError) as exc:
            for sock in sockets:
                sock.close(0)
            if auth is not None:
                auth.stop()
            what = "cannot bind " if isinstance(exc, zmq.ZMQError) else "CURVE keys: "
            raise ValueError(f"--kv-events-config: {what}{exc}") from None
        if keys is None:
            for address in (self.endpoint, self.replay_endpoint):
                if address is not None and not is_loopback(address):
                    log.warning(
                        "kv_events.unauthenticated_endpoint",
                        endpoint=address,
                        detail="the prompt token ids of every cached block are published to anyone "
                        "who can connect; bind loopback or configure CURVE",
                    )
        return pub, router, auth

    def _run(self) -> None:
        # A context of its own: the CURVE authenticator (ZAP) then applies to these sockets only.
        ctx = zmq.Context()
        try:
            pub, router, auth = self._open(ctx)
        except ValueError as exc:
            self._error = exc
            ctx.term()
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
                        self._replay(router, router.recv_multipart(copy=False))
        except Exception as exc:  # a publisher failure must not pass silently
            log.error("kv_events.publisher_failed", error=str(exc))
            raise
        finally:
            pub.close()
            if router is not None:
                router.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _send(self, pub: zmq.Socket, seq: int, ts: float, events: list[KVEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(ts, events, self.rank))
        pub.send_multipart([self.topic, _seq_bytes(seq), payload], copy=False)
        self._buffer.append((seq, payload))
        self.sent += 1

    def _replay(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity, start_frame = frames[0].bytes, frames[-1].bytes
        try:  # the peer's address (tcp): reconnecting under a new identity does not reset its budget
            requester: object = frames[-1].get("Peer-Address") or identity
        except zmq.ZMQError:
            requester = identity
        if not self._limiter.allow(requester):
            self.replays_refused += 1
            if _power_of_two(self.replays_refused):
                log.warning("kv_events.replay_refused", requester=str(requester), refused_total=self.replays_refused)
            router.send_multipart([identity, b"", _seq_bytes(END_OF_REPLAY), REPLAY_REFUSED])
            return
        if len(start_frame) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            start = self.next_seq  # nothing to resend; still answer with the end marker
        else:
            start = _seq_of(start_frame)
        for seq, payload in list(self._buffer):
            if seq >= start:
                router.send_multipart([identity, b"", _seq_bytes(seq), payload], copy=False)
        router.send_multipart([identity, b"", _seq_bytes(END_OF_REPLAY), b""])


class KVEventConsumer:
    """Subscribes to a publisher and keeps a ``KVBlockIndex`` (synchronous; one thread).

    For a CURVE publisher, ``server_key_file`` is its public certificate and ``client_key_file``
    this consumer's secret certificate (whose public half the publisher authorizes).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        index: KVBlockIndex | None = None,
        server_key_file: str | None = None,
        client_key_file: str | None = None,
        replay_timeout: float = 5.0,
    ) -> None:
        self.index = index or KVBlockIndex()
        self.replay_timeout = replay_timeout
        """Seconds `poll` gives one replay that fills a gap (a large gap on a busy machine takes longer)."""
        self.last_seq = -1
        self.replay_endpoint = replay_endpoint
        self._ctx = zmq.Context.instance()
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if (server_key_file is None) != (client_key_file is None):
            raise ValueError("CURVE needs both the publisher's public key and this consumer's key pair")
        if server_key_file is not None and client_key_file is not None:
            server_public, _ = zmq.auth.load_certificate(server_key_file)
            public, secret = zmq.auth.load_certificate(client_key_file)
            if secret is None:
                raise ValueError(f"{client_key_file} holds no secret key")
            self._curve = (server_public, public, secret)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.batches = 0
        self.gaps = 0
        self.lost = 0
        """Batches never seen: dropped by the publisher, or gone from its replay buffer."""

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self._curve
        return sock

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
        self.lost += seq - self.last_seq - 1
        self.last_seq = seq
        self.batches += 1
        return [(seq, event) for event in batch.events]

    def replay(self, from_seq: int = 0, timeout: float = 5.0) -> list[tuple[int, KVEvent]]:
        """Fetch and apply every buffered batch from ``from_seq`` on (batches already applied are
        skipped); returns the new events with their batch's sequence number. Raises
        ``ReplayRefusedError`` when the publisher refuses (rate limit)."""
        if self.replay_endpoint is None:
            raise ValueError("no replay endpoint to replay from")
        dealer = self._socket(zmq.DEALER)
        # the request itself counts against the timeout: a send to a publisher that refuses this
        # consumer's handshake finds no peer to take it and would wait for one without end
        dealer.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        out: list[tuple[int, KVEvent]] = []
        deadline = time.monotonic() + timeout
        try:
            dealer.connect(self.replay_endpoint)
            try:
                dealer.send_multipart([b"", _seq_bytes(from_seq)])
            except zmq.Again:
                raise TimeoutError(f"{self.replay_endpoint} took no replay request within {timeout} s") from None
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000)):
                    raise TimeoutError(f"no end of replay from {self.replay_endpoint} within {timeout} s")
                frames = dealer.recv_multipart()
                seq = _seq_of(frames[-2])
                if seq == END_OF_REPLAY:
                    if frames[-1]:
                        raise ReplayRefusedError(f"{self.replay_endpoint}: {frames[-1].decode(errors='replace')}")
                    return out
                out += self._apply(seq, frames[-1])
        finally:
            dealer.close(0)

    def poll(self, timeout: float = 0.1) -> list[tuple[int, KVEvent]]:
        """Apply the live batches that arrive within ``timeout`` seconds (at least one waited for);
        a gap in the sequence numbers is filled from the replay endpoint first (what it cannot
        fill counts as ``lost``)."""
        out: list[tuple[int, KVEvent]] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            _topic, seq_frame, payload = self._sub.recv_multipart()
            seq = _seq_of(seq_frame)
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                self.gaps += 1
                try:
                    out += self.replay(self.last_seq + 1, self.replay_timeout)
                except ReplayRefusedError as exc:
                    log.warning("kv_events.gap_not_filled", error=str(exc))
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
    parser = argparse.ArgumentParser(prog="python -m sonar.offload.events", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    consume = sub.add_parser("consume", help="print events as JSON lines and keep a block index")
    consume.add_argument("endpoint", help="the publisher's PUB address, e.g. tcp://127.0.0.1:5557")
    consume.add_argument("--replay", dest="replay_endpoint", help="the replay (ROUTER) address")
    consume.add_argument("--topic", default="")
    consume.add_argument("--from-seq", type=int, default=0, help="replay from this sequence number first")
    consume.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    consume.add_argument("--server-key", help="CURVE: the publisher's public certificate file")
    consume.add_argument("--client-key", help="CURVE: this consumer's secret certificate file")
    keygen = sub.add_parser("keygen", help="write a CURVE key pair: NAME.key (public), NAME.key_secret")
    keygen.add_argument("directory")
    keygen.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "keygen":
        os.makedirs(args.directory, mode=0o700, exist_ok=True)
        public, secret = zmq.auth.create_certificates(args.directory, args.name)
        os.chmod(secret, 0o600)
        print(json.dumps({"public": public, "secret": secret}))
        return 0
    with KVEventConsumer(
        args.endpoint,
        args.replay_endpoint,
        topic=args.topic,
        server_key_file=args.server_key,
        client_key_file=args.client_key,
    ) as consumer:
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
        print(
            json.dumps(
                {
                    "summary": consumer.index.summary(),
                    "last_seq": consumer.last_seq,
                    "ignored_removals": consumer.index.ignored_removals,
                    "lost": consumer.lost,
                }
            ),
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
