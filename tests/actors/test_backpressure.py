"""A bounded mailbox slows a fast sender down and loses nothing."""

import time

import pytest

from sonar.actors import ChildSpec, SupervisorSpec, supervise
from tests.actors.sample import Note, Notes, Sample

pytestmark = pytest.mark.anyio


async def test_fast_sender_is_slowed_and_nothing_is_lost(placement, monkeypatch):
    # Small ZMQ queues, so the bound is close to the mailbox's own in the child-process case too;
    # the padding fills the socket buffers between the processes.
    monkeypatch.setenv("SONAR_ACTOR_HWM", "2")
    delay, count, capacity = 0.02, 60, 4
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec(
                "slow", Sample, kwargs={"delay": delay}, placement=placement, mailbox_size=capacity, ping_interval=None
            )
        ],
    )
    async with supervise(spec) as sup:
        ref = sup.child("slow").ref
        t0 = time.monotonic()
        for i in range(count):
            await ref.send(Note(i, pad=b"x" * 65536))
        sent_in = time.monotonic() - t0
        assert await ref.ask(Notes(), timeout=30) == list(range(count))
    # Unbounded, the sends would take microseconds. Bounded, the sender has to wait for all but
    # the messages that fit in the queues (mailbox + ZMQ + socket buffers: well under half here).
    assert sent_in > (count / 2) * delay
