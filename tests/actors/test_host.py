"""The actor host a supervisor starts as a child process (`python -m sonar actor --parent ...`):
its start runs without the cyclic garbage collector, which is back on, with the start's heap
frozen, once its actor is ready (`sonar.heap`)."""

import gc

import pytest

from sonar.actors import ChildProcess, ChildSpec, SupervisorSpec, supervise
from tests.actors.sample import HeapState, Sample

pytestmark = pytest.mark.anyio


async def test_a_child_collects_garbage_once_its_actor_is_ready_with_its_start_frozen():
    frozen_here = gc.get_freeze_count()
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=ChildProcess(), ping_interval=None)])
    async with supervise(spec) as sup:
        state = await sup.child("a").ref.ask(HeapState(), timeout=10)
    assert state["enabled"]
    assert state["frozen"] > 1000  # the interpreter, anyio, msgspec, zmq and the actor's module at least
    assert gc.isenabled() and gc.get_freeze_count() == frozen_here  # the supervisor's process is left alone
