"""The live tree as data: names, placements, pids, states, restart counts, mailbox depths."""

import os

import msgspec
import pytest

from sonar.actors import ActorInfo, ChildProcess, ChildSpec, InProcess, SupervisorSpec, supervise
from tests.actors.helpers import wait_for
from tests.actors.sample import Crash, Hang, Note, Sample

pytestmark = pytest.mark.anyio


async def test_tree_reports_each_actor_and_survives_json():
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("local", Sample, placement=InProcess(), ping_interval=0.1, ping_timeout=30),
            SupervisorSpec("inner", [ChildSpec("child", Sample, placement=ChildProcess(), ping_interval=0.1)]),
        ],
    )
    async with supervise(spec) as sup:
        await wait_for(lambda: sup.tree().find("child").mailbox_depth is not None)
        await sup.child("inner").child.child("child").ref.send(Crash())
        await wait_for(
            lambda: (
                sup.tree().find("child").restarts == 1
                and sup.tree().find("child").state == "running"
                and sup.tree().find("child").mailbox_depth is not None
            )
        )
        # A stuck actor's queue grows: pings report the depth seen when they are answered,
        # so look at the mailbox itself while the actor is stuck.
        local = sup.child("local")
        await local.ref.send(Hang())
        for i in range(5):
            await local.ref.send(Note(i))
        tree = sup.tree()
        assert tree.name == "root" and tree.kind == "supervisor" and tree.pid == os.getpid()
        assert [c.name for c in tree.children] == ["local", "inner"]
        loc = tree.find("local")
        assert (loc.kind, loc.placement, loc.pid, loc.state, loc.restarts) == (
            "actor",
            "inprocess",
            os.getpid(),
            "running",
            0,
        )
        child = tree.find("child")
        assert child.placement == "process" and child.pid != os.getpid() and child.restarts == 1
        assert child.last_exit == "crash" and child.mailbox_depth == 0
        assert tree.find("inner").kind == "supervisor"
        from sonar.actors.node import get_node

        assert get_node().mailboxes[local.ref.name].depth() >= 5
        round_trip = msgspec.json.decode(msgspec.json.encode(tree), type=ActorInfo)
        assert round_trip == tree
