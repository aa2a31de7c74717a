"""send/ask through a mailbox, in this process and across a process boundary."""

import os
from typing import Union

import anyio
import msgspec
import pytest

from sonar.actors import ActorError, ActorRef, Ask, AskTimeout, ChildSpec, SupervisorSpec, supervise
from tests.actors.sample import Add, Echo, FailAsk, Hang, Note, Notes, Other, Sample, Whoami

pytestmark = pytest.mark.anyio


def tree(placement, **kwargs):
    child = ChildSpec("a", Sample, kwargs=kwargs, placement=placement, ping_interval=None)
    return SupervisorSpec("root", [child])


async def test_send_and_ask_round_trip(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        assert await a.ask(Echo("hello"), timeout=5) == "hello"
        for v in range(5):
            await a.send(Note(v))
        assert await a.ask(Add(5), timeout=5) == [0, 1, 2, 3, 4, 5]
        who = await a.ask(Whoami(), timeout=5)
        assert who["name"] == "a"
        assert (who["pid"] == os.getpid()) == (placement.__class__.__name__ == "InProcess")


async def test_ask_timeout_raises(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        await a.send(Hang())
        with anyio.fail_after(3):
            with pytest.raises(AskTimeout, match="did not answer Echo"):
                await a.ask(Echo("x"), timeout=0.3)


async def test_wrong_message_is_rejected_at_the_sender(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        with pytest.raises(TypeError, match="does not accept Other; its protocol is: Echo, Add"):
            await a.send(Other())
        with pytest.raises(TypeError, match="expects no reply"):
            await a.ask(Note(1))
        assert await a.ask(Echo("still fine"), timeout=5) == "still fine"


class Intruder(Ask, tag=True):
    """Not in Sample's protocol: sent through a reference that claims a different protocol."""

    payload: str


IntruderMsg = Union[Intruder, Echo]


async def test_undecodable_message_is_reported_and_actor_survives(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        liar = ActorRef(a.name, IntruderMsg, a.address)
        with pytest.raises((ActorError, TypeError), match="Intruder|decode"):
            await liar.ask(Intruder("boo"), timeout=5)
        assert await a.ask(Echo("alive"), timeout=5) == "alive"
        assert sup.child("a").restarts == 0


async def test_failure_while_answering_reaches_the_asker_as_data(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        with pytest.raises(ActorError) as info:
            await a.ask(FailAsk(), timeout=5)
        err = info.value.error
        assert err.type == "builtins.RuntimeError"
        assert err.message == "a was told to crash"
        assert "sample.py" in err.traceback and "raise RuntimeError" in err.traceback
        assert info.value.actor == "a"
        # the actor crashed; its supervisor restarted it
        with anyio.fail_after(10):
            while sup.child("a").restarts < 1 or sup.child("a").state != "running":
                await anyio.sleep(0.02)
        assert await sup.child("a").ref.ask(Notes(), timeout=5) == []


async def test_many_concurrent_asks_each_get_their_own_reply(placement):
    async with supervise(tree(placement)) as sup:
        a = sup.child("a").ref
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            results[i] = await a.ask(Echo(f"m{i}"), timeout=10)

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
        assert results == {i: f"m{i}" for i in range(200)}


def test_protocol_members_must_be_tagged_structs():
    class Plain(msgspec.Struct):
        x: int

    class Tagged(msgspec.Struct, tag=True):
        y: int

    with pytest.raises(TypeError, match="must be tagged"):
        ActorRef("x", Union[Plain, Tagged])
    with pytest.raises(TypeError, match="not a msgspec.Struct"):
        ActorRef("x", int)


async def test_failing_the_asks_of_an_ended_remote_actor_spares_its_namesake_elsewhere():
    """Hosts on other machines each run their actor under its plain name (a data-parallel replica's
    ``worker``): the end of one fails only the asks that went to its address."""
    from sonar.actors.node import get_node

    node = get_node()
    _, here = node.new_ask(None, "worker", "worker", "tcp://10.0.0.7:13346")
    _, there = node.new_ask(None, "worker", "worker", "tcp://10.0.0.8:13347")
    try:
        assert node.fail_asks("worker", "it ended", "tcp://10.0.0.7:13346") == 1
        assert here.done() and not there.done()
        assert node.fail_asks("worker", "it ended") == 1 and there.done()
    finally:
        for fut in (here, there):
            if fut.done():
                fut.exception()
