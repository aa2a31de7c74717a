"""A one-actor host (`python -m sonar actor --listen ADDRESS --exit-with-actor`), as a headless
node keeps one per tensor-parallel rank (`sonar.engine.node_agent`): it runs one actor and exits
with it, a second spawn is refused as `HostEnding`, and a supervisor's `Remote` placement reaches
the successor a restarter starts at the same address."""

import subprocess
import threading
import time

import pytest

from sonar.actors import ActorError, ActorRef, ChildSpec, Remote, SupervisorSpec, supervise
from sonar.actors.host import HOST_NAME, HostMsg, Spawn
from tests.actors.helpers import free_tcp_address, start_host, stop_host, wait_for
from tests.actors.sample import Crash, Echo, Whoami

pytestmark = pytest.mark.anyio


async def test_a_one_actor_host_refuses_a_second_spawn(deployment):
    address = free_tcp_address()
    proc = start_host(address, deployment, "--exit-with-actor")
    try:
        host = ActorRef(HOST_NAME, HostMsg, address)
        spawn = Spawn(name="only", target="tests.actors.sample:Sample")
        assert (await host.ask(spawn, timeout=30)).pid == proc.pid
        with pytest.raises(ActorError, match="HostEnding: this host ran its one actor"):
            await host.ask(spawn, timeout=10)
    finally:
        stop_host(proc)


async def test_a_crashed_actor_takes_its_host_and_the_restart_reaches_the_successor(deployment):
    address = free_tcp_address()
    hosts: list[subprocess.Popen] = [start_host(address, deployment, "--exit-with-actor")]
    done = threading.Event()

    def restarter() -> None:  # what a headless node's agent does
        while not done.is_set():
            if hosts[-1].poll() is not None:
                hosts.append(start_host(address, deployment, "--exit-with-actor"))
            done.wait(0.1)

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    spec = SupervisorSpec("root", [ChildSpec("far", "tests.actors.sample:Sample", placement=Remote(address))])
    try:
        async with supervise(spec) as sup:
            far = sup.child("far")
            first = (await far.ref.ask(Whoami(), timeout=10))["pid"]
            await far.ref.send(Crash())
            await wait_for(lambda: far.restarts == 1 and far.state == "running", timeout=30)
            assert hosts[0].wait(10) == 1  # the host ended with its crashed actor
            assert (await far.ref.ask(Whoami(), timeout=10))["pid"] == hosts[-1].pid != first
            assert await far.ref.ask(Echo("again"), timeout=10) == "again"
    finally:
        done.set()
        thread.join()
        for proc in hosts:
            stop_host(proc)


async def test_a_killed_host_whose_successor_never_heard_of_the_actor_still_restarts_it(deployment):
    """SIGKILL takes the host and its actor without a word: the ping deadline finds the actor hung
    (the fresh host the restarter started keeps the pings for the actor it expects, as a headless
    node's do), the `Kill` reaches that host (which ran nothing), and the runner counts the run as
    ended instead of waiting for a monitor that will never answer."""
    address = free_tcp_address()
    hosts: list[subprocess.Popen] = [start_host(address, deployment, "--exit-with-actor", "--expect", "far")]
    done = threading.Event()

    def restarter() -> None:
        while not done.is_set():
            if hosts[-1].poll() is not None:
                hosts.append(start_host(address, deployment, "--exit-with-actor", "--expect", "far"))
            done.wait(0.1)

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    child = ChildSpec("far", "tests.actors.sample:Sample", placement=Remote(address), ping_interval=0.5, ping_timeout=2)
    try:
        async with supervise(SupervisorSpec("root", [child], max_restarts=3, period=60)) as sup:
            far = sup.child("far")
            await far.ref.ask(Whoami(), timeout=10)
            hosts[0].kill()
            await wait_for(lambda: far.restarts == 1 and far.state == "running", timeout=30)
            assert (await far.ref.ask(Whoami(), timeout=10))["pid"] == hosts[-1].pid != hosts[0].pid
    finally:
        done.set()
        thread.join()
        for proc in hosts:
            stop_host(proc)


async def test_a_shutdown_ends_a_restart_that_waits_for_a_host_that_never_comes(deployment):
    """A node lost for good: the restart waits (up to the start timeout) for a host at the address;
    the supervisor's shutdown ends that wait instead of waiting it out."""
    address = free_tcp_address()
    proc = start_host(address, deployment, "--exit-with-actor")
    child = ChildSpec("far", "tests.actors.sample:Sample", placement=Remote(address, start_timeout=600))
    try:
        async with supervise(SupervisorSpec("root", [child])) as sup:
            far = sup.child("far")
            await far.ref.ask(Whoami(), timeout=10)
            proc.kill()  # the host and nobody to start its successor
            await far.fail("its node is gone")
            await wait_for(lambda: far.state == "starting", timeout=10)
            began = time.monotonic()
        assert time.monotonic() - began < 10 and far.state != "running"
    finally:
        stop_host(proc)
