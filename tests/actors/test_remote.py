"""An actor host listening on TCP (`python -m sonar actor --listen`), as another machine would run it."""

import anyio
import pytest
import torch

from sonar.actors import ChildSpec, Remote, SupervisorSpec, parse_placement, supervise
from tests.actors.helpers import free_tcp_address, start_host, stop_host, wait_for
from tests.actors.sample import Crash, Echo, Hang, Sample, Tensors, Whoami

pytestmark = pytest.mark.anyio


@pytest.fixture
def host(deployment):
    address = free_tcp_address()
    proc = start_host(address, deployment)
    yield address, proc
    stop_host(proc)


async def test_remote_actor_round_trip_restart_and_stop(host):
    address, proc = host
    placement = parse_placement(address)
    assert placement == Remote(address)
    spec = SupervisorSpec("root", [ChildSpec("far", Sample, placement=placement, ping_interval=0.2, ping_timeout=10)])
    async with supervise(spec) as sup:
        far = sup.child("far")
        assert far.placement == address and far.pid == proc.pid
        assert await far.ref.ask(Echo("over tcp"), timeout=10) == "over tcp"
        assert (await far.ref.ask(Whoami(), timeout=10))["pid"] == proc.pid
        t = torch.randn(1000, 100)
        reply = await far.ref.ask(Tensors([t]), timeout=10)
        assert torch.equal(reply["first"], t)
        await far.ref.send(Crash())
        await wait_for(lambda: far.restarts == 1 and far.state == "running")
        assert far.last_exit.reason == "crash"
        assert await far.ref.ask(Echo("restarted"), timeout=10) == "restarted"
        await far.ref.send(Hang())  # liveness works across machines too
        await wait_for(lambda: far.restarts == 2 and far.state == "running")
        assert [e.kind for e in sup.events if e.kind == "hung"] == ["hung"]
    assert proc.poll() is None  # the host outlives the supervisor that used it


async def test_unreachable_remote_host_fails_the_start(deployment):
    spec = SupervisorSpec(
        "root", [ChildSpec("nobody", Sample, placement=Remote("tcp://127.0.0.1:1", start_timeout=0.5))]
    )
    with anyio.fail_after(10):
        with pytest.raises(RuntimeError, match="no actor host answered at tcp://127.0.0.1:1"):
            async with supervise(spec):
                pass


async def test_remote_placement_needs_the_deployment_keys():
    """Without keys a supervisor has only its own process tree's: it says so rather than time out."""
    spec = SupervisorSpec("root", [ChildSpec("far", Sample, placement=Remote("tcp://127.0.0.1:1", start_timeout=0.5))])
    with anyio.fail_after(10):
        with pytest.raises(RuntimeError, match="needs the deployment's keys"):
            async with supervise(spec):
                pass


async def test_a_stop_ends_at_once_when_the_remote_host_is_known_gone(host):
    """A host frozen mid-run (SIGSTOP: its sockets stay open, nothing answers) makes a stop wait
    out its shutdown deadline; told that the host is gone (a node's agent saw it end), the stop ends
    at once and the run ends as failed with that reason."""
    import os
    import signal
    import time

    address, proc = host
    spec = SupervisorSpec("root", [ChildSpec("far", Sample, placement=Remote(address), shutdown=30, ping_timeout=60)])
    async with supervise(spec) as sup:
        far = sup.child("far")
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(far.stop)
                    await wait_for(lambda: far.state == "stopping")
                    far.host_ended("its host ended, as its node reported")
            assert time.monotonic() - started < 10  # not the 30 s deadline
            assert far.state == "stopped"
            assert far.last_exit is not None and far.last_exit.reason == "its host ended, as its node reported"
        finally:
            os.kill(proc.pid, signal.SIGCONT)
