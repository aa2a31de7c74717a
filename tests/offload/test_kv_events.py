"""KV events over real ZMQ sockets: the wire format, replay, gap filling, the reference consumer;
and what keeps them safe: a loopback default, a warning for other interfaces, CURVE, a publish
that never blocks, rate-limited replay."""

import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
import zmq.auth

from sonar.core.kv_index import KVBlockIndex
from sonar.offload import events as kv_events
from sonar.offload.config import KVEventsConfig
from sonar.offload.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventConsumer,
    KVEventPublisher,
    RateLimiter,
    ReplayRefusedError,
    is_loopback,
)


def cfg(**kw):
    base = dict(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv",
    )
    base.update(kw)
    return KVEventsConfig(**base)


def stored(*hashes, medium="CPU"):
    return BlockStored(
        [h.encode() if isinstance(h, str) else h for h in hashes], None, list(range(4 * len(hashes))), 4, medium=medium
    )


def removed(*hashes, medium="CPU"):
    return BlockRemoved([h.encode() for h in hashes], medium)


def test_index_reference_counts_and_ignores_unknown_removals():
    index = KVBlockIndex()
    index.apply_all([stored("a", "b"), stored("b", "c"), removed("b"), removed("zz")])
    assert index.blocks("CPU") == {b"a", b"b", b"c"} and index.ignored_removals == 1
    index.apply_all([removed("b"), removed("b")])  # the second removal of b is unknown by then
    assert index.blocks("CPU") == {b"a", b"c"} and index.ignored_removals == 2
    index.apply_all([stored("a", medium="DISK"), stored("g", medium="GPU"), AllBlocksCleared("CPU")])
    assert index.blocks("CPU") == set() and index.blocks("DISK") == {b"a"} and index.has(b"g", "GPU")
    index.apply(AllBlocksCleared())
    assert index.summary() == {"GPU": 0, "CPU": 0, "DISK": 0}


def wait_subscribed(pub: KVEventPublisher, consumer: KVEventConsumer) -> None:
    """Publish probes until the SUB socket gets one (ZMQ's slow joiner), via the replay fill."""
    deadline = time.monotonic() + 10
    while not consumer.poll(0.05):
        assert time.monotonic() < deadline, "the subscription never took effect"
        pub.publish([stored("probe", medium="GPU")])


def test_wire_format_on_a_raw_sub_socket():
    with KVEventPublisher(cfg(replay_endpoint=None)) as pub:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        try:
            deadline = time.monotonic() + 10
            while not sub.poll(50):
                assert time.monotonic() < deadline
                pub.publish([stored("h1")])
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            ts, events, rank = msgspec.msgpack.decode(payload)  # plain msgpack, no Sonar types needed
            assert isinstance(ts, float) and rank is None
            assert events == [["BlockStored", [b"h1"], None, [0, 1, 2, 3], 4, None, "CPU", None]]
        finally:
            sub.close(0)


def test_live_stream_and_replay_from_a_sequence_number():
    with KVEventPublisher(cfg()) as pub, KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as consumer:
        wait_subscribed(pub, consumer)
        pub.publish([stored("a", "b")])
        pub.publish([removed("a"), stored("c")])
        deadline = time.monotonic() + 10
        while consumer.index.blocks("CPU") != {b"b", b"c"}:
            consumer.poll(0.05)
            assert time.monotonic() < deadline
        last = consumer.last_seq
        # a second consumer replays everything from 0 and agrees
        with KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as late:
            late.replay(0)
            assert late.last_seq == last and late.index.refs == consumer.index.refs
        with KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as tail:
            assert tail.replay(last) == [(last, removed("a")), (last, stored("c"))]


def test_the_ring_buffer_keeps_buffer_steps_batches():
    with KVEventPublisher(cfg(buffer_steps=3)) as pub:
        for i in range(6):
            pub.publish([stored(f"h{i}")])
        with KVEventConsumer(pub.endpoint, pub.replay_endpoint) as consumer:
            deadline = time.monotonic() + 10
            while pub.sent < 6:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            consumer.replay(0)
            assert consumer.last_seq == 5 and consumer.index.blocks("CPU") == {b"h3", b"h4", b"h5"}


def test_a_late_consumer_fills_the_gap_from_the_replay_endpoint():
    with KVEventPublisher(cfg()) as pub:
        for i in range(5):
            pub.publish([stored(f"early{i}")])
        while pub.sent < 5:  # sent before the consumer exists
            time.sleep(0.01)
        with KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as consumer:
            wait_subscribed(pub, consumer)  # its first live batch has seq >= 5: a gap, filled by replay
            assert consumer.gaps == 1
            assert {f"early{i}".encode() for i in range(5)} <= consumer.index.blocks("CPU")


def test_topic_filtering():
    with KVEventPublisher(cfg(topic="other")) as pub, KVEventConsumer(pub.endpoint, topic="kv") as consumer:
        for _ in range(20):
            pub.publish([stored("x")])
            assert consumer.poll(0.02) == []


def test_bind_failure_is_a_clear_error():
    with KVEventPublisher(cfg(replay_endpoint=None)) as pub:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(cfg(endpoint=pub.endpoint, replay_endpoint=None))


def test_the_reference_consumer_command_line():
    with KVEventPublisher(cfg()) as pub:
        pub.publish([stored("a", "b")])
        pub.publish([removed("a"), removed("nope")])
        while pub.sent < 2:
            time.sleep(0.01)
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "sonar.offload.events",
                "consume",
                pub.endpoint,
                "--replay",
                pub.replay_endpoint,
                "--topic",
                "kv",
                "--duration",
                "0.3",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert proc.returncode == 0, proc.stderr
    lines = [msgspec.json.decode(line) for line in proc.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 1]
    assert lines[0]["event"] == ["BlockStored", [b"a".hex(), b"b".hex()], None, list(range(8)), 4, None, "CPU", None]
    summary = msgspec.json.decode(proc.stderr.strip().splitlines()[-1])
    assert summary["summary"]["CPU"] == 1 and summary["ignored_removals"] == 1 and summary["last_seq"] == 1


# -- safety ---------------------------------------------------------------------------------------
class LogRecorder:
    """Stands in for the module's logger: keeps (event, fields) pairs."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((level, event, fields))

    def events(self, name: str) -> list[tuple[str, dict]]:
        return [(level, fields) for level, event, fields in self.records if event == name]


@pytest.fixture
def logs(monkeypatch) -> LogRecorder:
    recorder = LogRecorder()
    monkeypatch.setattr(kv_events, "log", recorder)
    return recorder


def _outside_address() -> str | None:
    """An address of this machine other than loopback (the route to a private range), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: picks a route, sends nothing
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_the_default_endpoint_listens_on_loopback_only(logs):
    default = KVEventsConfig().endpoint
    assert default == "tcp://127.0.0.1:5557" and is_loopback(default)
    # The default host, on a free port (5557 itself may be taken on a shared machine).
    with KVEventPublisher(cfg(endpoint=default.rsplit(":", 1)[0] + ":*", replay_endpoint=None)) as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        outside = _outside_address()
        if outside is not None:  # this machine's other interface: nothing listens there
            with pytest.raises(OSError):
                socket.create_connection((outside, port), timeout=5).close()
    assert not logs.events("kv_events.unauthenticated_endpoint")


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.8.9.1:1", True),
        ("tcp://localhost:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv", True),
        ("tcp://*:5557", False),
        ("tcp://0.0.0.0:5557", False),
        ("tcp://10.1.2.3:5557", False),
        ("tcp://eth0:5557", False),
        ("tcp://[::]:5557", False),
    ],
)
def test_is_loopback(endpoint, loopback):
    assert is_loopback(endpoint) == loopback


def test_binding_every_interface_warns_that_token_ids_are_unauthenticated(logs):
    with KVEventPublisher(cfg(endpoint="tcp://*:*", replay_endpoint="tcp://0.0.0.0:*")) as pub:
        assert pub.endpoint.startswith("tcp://0.0.0.0:")
    warnings = logs.events("kv_events.unauthenticated_endpoint")
    assert [fields["endpoint"] for _, fields in warnings] == [pub.endpoint, pub.replay_endpoint]
    assert all(level == "warning" and "token ids" in fields["detail"] for level, fields in warnings)


def test_publish_never_blocks_when_the_publisher_thread_stalls(logs):
    """A stalled publisher thread (here: held inside its send) never holds up `publish`: beyond
    `max_queue_size` waiting batches, new ones are dropped and counted, and their sequence numbers
    stay unused, so a consumer sees (and counts) what it lost."""
    stall, stalled = threading.Event(), threading.Event()
    with KVEventPublisher(cfg(max_queue_size=4)) as pub, KVEventConsumer(pub.endpoint, topic="kv") as consumer:
        wait_subscribed(pub, consumer)
        send = pub._send

        def stuck_send(*args):
            stalled.set()
            stall.wait(30)
            send(*args)

        pub._send = stuck_send
        first = pub.next_seq
        pub.publish([stored("held")])  # the thread takes it and stalls in its send
        assert stalled.wait(10)
        started = time.monotonic()
        for i in range(200):
            pub.publish([stored(f"b{i}")])
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"200 publishes took {elapsed:.2f} s"
        assert pub.dropped == 200 - 4 and pub.next_seq == first + 201
        pub._send = send
        stall.set()
        seen: list = []
        deadline = time.monotonic() + 10
        while consumer.last_seq < first + 4:
            seen += consumer.poll(0.05)
            assert time.monotonic() < deadline
        pub.publish([stored("after")])
        while consumer.last_seq < first + 201:
            seen += consumer.poll(0.05)
            assert time.monotonic() < deadline
    assert [seq for seq, _ in seen] == [first, first + 1, first + 2, first + 3, first + 4, first + 201]
    assert consumer.lost == 196  # no replay endpoint: the dropped sequence numbers stay a gap
    # logged at the 1st, 2nd, 4th, ... drop, not 196 times
    assert [f["dropped_total"] for _, f in logs.events("kv_events.dropped")] == [1, 2, 4, 8, 16, 32, 64, 128]


def test_a_subscriber_that_never_reads_does_not_stall_the_publisher():
    """ZMQ's PUB socket drops what a slow subscriber has not taken beyond its high-water mark:
    the publisher thread keeps sending, nothing is dropped at publish, and the subscriber fills
    what it missed from the replay endpoint (every gap is one replay: no rate limit here)."""
    n = 5000
    with (
        KVEventPublisher(cfg(hwm=10, buffer_steps=n + 10, replay_burst=n)) as pub,
        # replaying up to 5000 batches of 1024 tokens took over 5 s on a loaded CI machine
        KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv", replay_timeout=60) as consumer,
    ):
        wait_subscribed(pub, consumer)
        start = pub.next_seq
        tokens = list(range(64 * 16))
        for i in range(n):
            pub.publish([BlockStored([f"s{i}".encode()], None, tokens, 16, medium="CPU")])
        deadline = time.monotonic() + 30
        while pub.sent < start + n:  # the thread got through all of them, nobody reading
            assert time.monotonic() < deadline, f"the publisher stalled at {pub.sent}"
            time.sleep(0.01)
        assert pub.dropped == 0
        while consumer.poll(0.2):  # what reached the subscriber; the PUB socket dropped the rest
            assert time.monotonic() < deadline
        pub.publish([stored("last")])  # arrives: a gap before it (a tail drop) is filled by a replay
        while consumer.last_seq < start + n:
            consumer.poll(0.1)
            assert time.monotonic() < deadline
    assert consumer.gaps >= 1 and consumer.lost == 0
    assert {f"s{i}".encode() for i in range(n)} <= consumer.index.blocks("CPU")


def test_rate_limiter_token_bucket():
    now = [0.0]
    limiter = RateLimiter(2.0, 3, max_requesters=2, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b")  # per requester
    now[0] = 0.5  # one more token for "a" (2 per second)
    assert limiter.allow("a") and not limiter.allow("a")
    now[0] = 100.0  # refilled up to the burst, not beyond
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    limiter.allow("c")  # three requesters: the least recent ("b") is forgotten
    assert set(limiter._buckets) == {"a", "c"}


def test_replay_is_rate_limited_per_requester(logs):
    with KVEventPublisher(cfg(replay_rate_limit=0.1, replay_burst=3)) as pub:
        pub.publish([stored("a")])
        while pub.sent < 1:
            time.sleep(0.01)
        for _ in range(3):
            with KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as consumer:
                assert [seq for seq, _ in consumer.replay(0)] == [0]
        # A fourth request, on a fresh connection (a new ZMQ identity), from the same address.
        with KVEventConsumer(pub.endpoint, pub.replay_endpoint, topic="kv") as consumer:
            with pytest.raises(ReplayRefusedError, match="rate limited"):
                consumer.replay(0)
            assert consumer.index.blocks("CPU") == set()
        assert pub.replays_refused == 1
    assert [fields["requester"] for _, fields in logs.events("kv_events.replay_refused")] == ["127.0.0.1"]


def test_curve_lets_only_authorized_subscribers_in(tmp_path, logs):
    keys, authorized = tmp_path / "keys", tmp_path / "authorized"
    proc = subprocess.run(
        [sys.executable, "-m", "sonar.offload.events", "keygen", str(keys), "router"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert proc.returncode == 0, proc.stderr
    assert (keys / "router.key_secret").stat().st_mode & 0o077 == 0 and keys.stat().st_mode & 0o077 == 0
    for name in ("publisher", "stranger"):
        zmq.auth.create_certificates(keys, name)
    authorized.mkdir()
    (authorized / "router.key").write_bytes((keys / "router.key").read_bytes())
    config = cfg(
        endpoint="tcp://*:*",
        curve_secret_key_file=str(keys / "publisher.key_secret"),
        curve_authorized_keys_dir=str(authorized),
    )
    server_key = str(keys / "publisher.key")
    with KVEventPublisher(config) as pub:
        endpoint = pub.endpoint.replace("0.0.0.0", "127.0.0.1")
        with (
            KVEventConsumer(
                endpoint,
                pub.replay_endpoint,
                topic="kv",
                server_key_file=server_key,
                client_key_file=str(keys / "router.key_secret"),
            ) as good,
            KVEventConsumer(
                endpoint,
                pub.replay_endpoint,
                topic="kv",
                server_key_file=server_key,
                client_key_file=str(keys / "stranger.key_secret"),
            ) as stranger,
            KVEventConsumer(endpoint, pub.replay_endpoint, topic="kv") as plain,
        ):
            wait_subscribed(pub, good)
            for _ in range(20):
                pub.publish([stored("secret")])
                assert stranger.poll(0.02) == [] and plain.poll(0.02) == []
            assert good.replay(0) and b"secret" in good.index.blocks("CPU")
            for other in (stranger, plain):
                with pytest.raises(TimeoutError):
                    other.replay(0, timeout=0.5)
            assert stranger.index.blocks("CPU") == set() == plain.index.blocks("CPU")
    assert not logs.events("kv_events.unauthenticated_endpoint")


def test_curve_with_a_missing_key_file_is_a_clear_error(tmp_path):
    config = cfg(curve_secret_key_file=str(tmp_path / "nope.key_secret"), curve_authorized_keys_dir=str(tmp_path))
    with pytest.raises(ValueError, match="CURVE keys: .*nope.key_secret"):
        KVEventPublisher(config)
