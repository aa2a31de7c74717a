"""KV events over real ZMQ sockets: the wire format, replay, gap filling, the reference consumer."""

import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from sonar.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVBlockIndex, KVEventConsumer, KVEventPublisher
from sonar.offload.config import KVEventsConfig


def cfg(**kw):
    base = dict(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*", topic="kv")
    base.update(kw)
    return KVEventsConfig(**base)


def stored(*hashes, medium="CPU"):
    return BlockStored([h.encode() if isinstance(h, str) else h for h in hashes], None,
                       list(range(4 * len(hashes))), 4, medium=medium)


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
            while pub.next_seq < 6:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            consumer.replay(0)
            assert consumer.last_seq == 5 and consumer.index.blocks("CPU") == {b"h3", b"h4", b"h5"}


def test_a_late_consumer_fills_the_gap_from_the_replay_endpoint():
    with KVEventPublisher(cfg()) as pub:
        for i in range(5):
            pub.publish([stored(f"early{i}")])
        while pub.next_seq < 5:  # sent before the consumer exists
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
        while pub.next_seq < 2:
            time.sleep(0.01)
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        proc = subprocess.run(
            [sys.executable, "-m", "sonar.kv_events", "consume", pub.endpoint, "--replay", pub.replay_endpoint,
             "--topic", "kv", "--duration", "0.3"],
            capture_output=True, text=True, timeout=60, env=env,
        )
    assert proc.returncode == 0, proc.stderr
    lines = [msgspec.json.decode(line) for line in proc.stdout.splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 1]
    assert lines[0]["event"] == ["BlockStored", [b"a".hex(), b"b".hex()], None, list(range(8)), 4, None, "CPU", None]
    summary = msgspec.json.decode(proc.stderr.strip().splitlines()[-1])
    assert summary["summary"]["CPU"] == 1 and summary["ignored_removals"] == 1 and summary["last_seq"] == 1
