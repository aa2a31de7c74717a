"""The actor transport against hostile peers: a real `python -m sonar actor --listen` host, raw ZMQ
sockets as an attacker on the network would open them, and supervisors holding the keys."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import anyio
import msgspec
import pytest
import zmq

from sonar.actors import ActorError, ActorRef, ChildSpec, Remote, SupervisorSpec, keys, supervise
from sonar.actors.codec import Codec
from sonar.actors.host import HOST_NAME, HostMsg, Kill, Monitor, Spawn, Spawned
from sonar.actors.messages import ReplyTo, Stop
from sonar.actors.node import FrameTooLarge, get_node
from tests.actors.helpers import alive, free_tcp_address, start_host, stop_host
from tests.actors.sample import Echo, Hang, Note, Notes, Sample, SampleMsg, Tensors

pytestmark = pytest.mark.anyio

SAMPLE = "tests.actors.sample:Sample"
TOUCH = "tests.actors.sample:Touch"


@pytest.fixture
async def host(deployment, tmp_path):
    """A host with the deployment's keys; yields (address, process, path of its log). This
    process's node is closed afterwards (the tests talk to the host through bare refs)."""
    address = free_tcp_address()
    log = tmp_path / "host.log"
    proc = start_host(address, deployment, "--max-frame-bytes", str(2**20), log_path=log)
    node = get_node()
    node.users += 1
    try:
        yield address, proc, log
    finally:
        node.users -= 1
        if node.users == 0:
            node.close()
        stop_host(proc)


def message(name: str, msg, reply_to: ReplyTo | None = None) -> list[bytes]:
    """The frames a node sends for `msg` to the actor `name`."""
    if reply_to is not None:
        msg = msgspec.structs.replace(msg, reply_to=reply_to)
    return [b"M", name.encode(), *[bytes(f) for f in Codec().encode(msg)]]


class Peer(msgspec.Struct):
    """What a hand-written client knows: the server key it expects, its own keypair."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes


def raw_dealer(ctx: zmq.Context, address: str, peer: Peer | None, identity: bytes) -> zmq.Socket:
    """A bare DEALER, with CURVE keys or none at all, as a hand-written attacker would open it."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    if peer is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, peer.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, peer.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, peer.client_secret)
    sock.connect(address)
    return sock


def knock(sock: zmq.Socket, *messages: list[bytes]) -> None:
    """An intruder's sends, in order. Once the server refuses the handshake the socket has no peer
    left to queue for, and a blocking send waits forever: a send not queued within a second means
    the door is shut, and the rest are not tried."""
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    for frames in messages:
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            return


def member() -> Peer:
    """This process's keys (the deployment's)."""
    creds = keys.current()
    return Peer(creds.server_public, creds.client_public, creds.client_secret)


def stranger() -> Peer:
    """Another client key that knows the deployment's server key."""
    return Peer(keys.current().server_public, *zmq.curve_keypair())


def authorize(deployment, peer: Peer, name: str) -> None:
    (deployment / "authorized" / f"{name}.key").write_text(
        f'metadata\ncurve\n    public-key = "{peer.client_public.decode()}"\n'
    )


async def recv(sock: zmq.Socket, timeout: float) -> list[bytes] | None:
    def _recv() -> list[bytes] | None:
        return sock.recv_multipart() if sock.poll(int(timeout * 1000)) else None

    return await anyio.to_thread.run_sync(_recv)


async def spawn(address: str, name: str, target: str = SAMPLE, **kwargs) -> Spawned:
    return await ActorRef(HOST_NAME, HostMsg, address).ask(Spawn(name=name, target=target, kwargs=kwargs), timeout=30)


async def test_a_peer_without_the_keys_gets_nothing_run(host, deployment, tmp_path):
    address, proc, log = host
    marker, shell_marker = tmp_path / "spawned", tmp_path / "shell"
    ctx = zmq.Context()
    impostor = Peer(zmq.curve_keypair()[0], member().client_public, member().client_secret)
    try:
        for who, peer in [("plain", None), ("stranger", stranger()), ("wrong-server", impostor)]:
            sock = raw_dealer(ctx, address, peer, who.encode())
            to = ReplyTo(who, 1, None)
            knock(
                sock,
                message(HOST_NAME, Spawn(name="evil", target=TOUCH, kwargs={"path": str(marker)}), to),
                message(
                    HOST_NAME, Spawn(name="sh", target="os:system", kwargs={"command": f"touch {shell_marker}"}), to
                ),
                message(HOST_NAME, Stop()),
                message(HOST_NAME, Kill(name=HOST_NAME), to),
            )
            assert await recv(sock, 1.0) is None, who  # not even an error reply: nothing was read
            sock.close()
    finally:
        ctx.term()
    assert not marker.exists() and not shell_marker.exists()
    assert proc.poll() is None
    # The host still serves a supervisor that holds the keys.
    spec = SupervisorSpec("root", [ChildSpec("far", Sample, placement=Remote(address), ping_interval=None)])
    async with supervise(spec) as sup:
        assert await sup.child("far").ref.ask(Echo("still here"), timeout=10) == "still here"
    assert "actor.peer_refused" in log.read_text()


async def test_targets_off_the_allow_list_are_refused_with_the_keys_too(host, tmp_path):
    address, proc, log = host
    marker, shell_marker = tmp_path / "spawned", tmp_path / "shell"
    with pytest.raises(ActorError, match="not on this host's allow-list"):
        await spawn(address, "sh", "os:system", command=f"touch {shell_marker}")
    with pytest.raises(ActorError, match="not on this host's allow-list"):
        await spawn(address, "evil", TOUCH, path=str(marker))
    assert not marker.exists() and not shell_marker.exists()
    assert (await spawn(address, "good")).pid == proc.pid
    assert await ActorRef("good", SampleMsg, address).ask(Echo("ok"), timeout=10) == "ok"
    assert log.read_text().count("actor.message_refused") == 2


async def test_a_failed_spawn_leaves_the_host_serving(host):
    address, proc, log = host
    with pytest.raises(ActorError, match="refusing to start"):
        await spawn(address, "a", fail_start=True)
    with pytest.raises(ActorError, match="unexpected keyword argument"):
        await spawn(address, "a", no_such_argument=1)
    with pytest.raises(ActorError, match="already running"):
        await spawn(address, HOST_NAME)
    assert (await spawn(address, "a")).pid == proc.pid
    assert await ActorRef("a", SampleMsg, address).ask(Echo("after failures"), timeout=10) == "after failures"
    assert "actor.spawn_failed" in log.read_text()


async def test_only_the_owner_stops_or_kills_an_actor(host, deployment):
    address, proc, log = host
    other = stranger()
    authorize(deployment, other, "other")  # the host reads its allow-list at start: restart it
    proc.terminate()
    proc.wait(timeout=10)
    proc = start_host(address, deployment, "--max-frame-bytes", str(2**20), log_path=log)
    try:
        await spawn(address, "victim")
        victim = ActorRef("victim", SampleMsg, address)
        ctx = zmq.Context()
        try:
            sock = raw_dealer(ctx, address, other, b"other")
            to = ReplyTo("other", 7, None)
            sock.send_multipart(message("victim", Stop()))
            sock.send_multipart(message(HOST_NAME, Stop()))
            sock.send_multipart(message(HOST_NAME, Kill(name="victim"), to))
            reply = await recv(sock, 10)
            assert reply is not None and reply[:3] == [b"R", (7).to_bytes(8, "little"), b"err"]
            assert b"spawned by another supervisor" in reply[3]
            sock.send_multipart(message(HOST_NAME, Spawn(name="victim", target=SAMPLE), to))  # a takeover
            reply = await recv(sock, 10)
            assert reply is not None and b"spawned by another supervisor" in reply[3]
            sock.close()
        finally:
            ctx.term()
        await anyio.sleep(0.3)
        assert await victim.ask(Echo("alive"), timeout=10) == "alive"  # neither stopped nor replaced
        assert await victim.ask(Notes(), timeout=10) == []
        await victim.send(Stop())  # its owner may
        ended = await ActorRef(HOST_NAME, HostMsg, address).ask(Monitor(name="victim"), timeout=10)
        assert (ended.normal, ended.reason) == (True, "normal")
        with pytest.raises(ActorError, match="no actor named 'victim'"):
            await victim.ask(Echo("?"), timeout=5)
        assert (await spawn(address, "after")).pid == proc.pid  # the host actor took no Stop
        text = log.read_text()
        assert text.count("actor.message_refused") >= 4
        assert "only the supervisor that spawned an actor may stop it" in text
    finally:
        stop_host(proc)


async def test_listen_beyond_loopback_without_keys_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SONAR_ACTOR_")}
    env["PYTHONPATH"] = os.getcwd()
    port = free_tcp_address().rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "sonar", "actor", "--listen", f"tcp://0.0.0.0:{port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "refusing to listen without credentials (tcp://0.0.0.0:" in done.stderr
    assert "reachable from other machines" in done.stderr and "sonar actor keygen" in done.stderr


async def test_keygen_writes_private_key_files(deployment):
    assert stat.S_IMODE(deployment.stat().st_mode) == 0o700
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((deployment / secret).stat().st_mode) == 0o600
    creds = keys.Credentials.from_dir(deployment)
    assert creds.client_public in creds.authorized and creds.server_secret is not None
    os.chmod(deployment / "client.key_secret", 0o644)
    with pytest.raises(keys.KeysError, match="readable by other users"):
        keys.Credentials.from_dir(deployment)


async def test_an_oversized_frame_is_refused_and_the_host_lives_on(host, monkeypatch):
    address, proc, _ = host
    ctx = zmq.Context()
    try:
        sock = raw_dealer(ctx, address, member(), b"big")
        frames = message(
            HOST_NAME, Spawn(name="big", target=SAMPLE, kwargs={"start_delay": 0.0}), ReplyTo("big", 1, None)
        )
        sock.send_multipart(frames + [b"x" * (2**20 + 1)])  # over the host's --max-frame-bytes
        assert await recv(sock, 1.0) is None  # dropped with the connection, unread
        sock.close()
    finally:
        ctx.term()
    assert proc.poll() is None
    await spawn(address, "small")
    small = ActorRef("small", SampleMsg, address)
    import torch

    under = torch.zeros(2**20 // 4 - 1024)
    assert (await small.ask(Tensors([under]), timeout=10))["sums"] == [0.0]
    monkeypatch.setattr(get_node(), "max_frame_bytes", 2**20)  # this side refuses to send what the far side would drop
    with pytest.raises(FrameTooLarge, match="SONAR_ACTOR_MAX_FRAME_BYTES"):
        await small.ask(Tensors([torch.zeros(2**20)]), timeout=10)


async def test_a_reply_from_another_peer_is_ignored(host):
    """Our node asks a peer (a raw ROUTER here, so the test sees the reply address); a third peer
    that learnt the ask id answers first: its reply is dropped, the asked peer's is taken."""
    creds = keys.current()
    ctx = zmq.Context()
    asked = ctx.socket(zmq.ROUTER)
    asked.setsockopt(zmq.LINGER, 0)
    asked.setsockopt(zmq.CURVE_SERVER, 1)
    asked.setsockopt(zmq.CURVE_SECRETKEY, creds.server_secret)
    port = asked.bind_to_random_port("tcp://127.0.0.1")
    try:
        node = get_node()
        home = node.ensure_bound()
        pending = await ActorRef("echo", SampleMsg, f"tcp://127.0.0.1:{port}").ask_soon(Echo("hi"))
        frames = await recv(asked, 10)
        assert frames is not None and frames[1:3] == [b"M", b"echo"]
        reply_to = Codec().decode(frames[3:], Echo).reply_to
        assert reply_to.id > 2**32  # not a counter
        mole = ctx.socket(zmq.DEALER)  # a member of the tree, on our private ipc socket
        mole.setsockopt(zmq.LINGER, 0)
        mole.setsockopt(zmq.ROUTING_ID, b"mole")
        mole.setsockopt(zmq.PLAIN_USERNAME, creds.client_public)
        mole.setsockopt(zmq.PLAIN_PASSWORD, creds.link_password)
        mole.connect(home)
        mole.send_multipart([b"R", reply_to.id.to_bytes(8, "little"), b"ok", msgspec.msgpack.encode("forged")])
        await anyio.sleep(0.5)
        asked.send_multipart(
            [frames[0], b"R", reply_to.id.to_bytes(8, "little"), b"ok", msgspec.msgpack.encode("genuine")]
        )
        assert await pending.result(timeout=10) == "genuine"
        mole.close()
    finally:
        asked.close()
        ctx.term()


async def test_a_full_mailbox_holds_its_sender_not_the_node(host):
    address, _, _ = host
    spec = SupervisorSpec(
        "root",
        [
            ChildSpec("slow", Sample, placement=Remote(address), mailbox_size=2, ping_interval=None, shutdown=0.5),
            ChildSpec("fast", Sample, placement=Remote(address), ping_interval=None),
        ],
    )
    async with supervise(spec) as sup:
        slow, fast = sup.child("slow").ref, sup.child("fast").ref
        await slow.send(Hang())  # blocks the slow actor's mailbox loop for good
        for i in range(20):  # fills its mailbox and more
            await slow.send(Note(i))
        await anyio.sleep(0.3)
        # The other actor on the same node still receives and answers ...
        for i in range(5):
            assert await fast.ask(Echo(f"fast {i}"), timeout=5) == f"fast {i}"
        # ... while the slow one's sender is held.
        sent = 0
        with anyio.move_on_after(0.5):
            for i in range(20):
                await slow.send(Note(100 + i))
                sent += 1
        assert sent <= 1
        pong = await fast.ask(Echo("end"), timeout=5)
        assert pong == "end"


async def test_child_processes_get_their_keys_outside_argv(placement):
    spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=placement, ping_interval=None)])
    async with supervise(spec) as sup:
        child = sup.child("a")
        assert await child.ref.ask(Echo("hi"), timeout=10) == "hi"
        if child.placement != "process":
            return
        creds = get_node().credentials
        assert creds.ephemeral  # no deployment configured: this process tree's own keys
        with open(f"/proc/{child.pid}/cmdline", "rb") as f:
            argv = f.read()
        for secret in (creds.server_secret, creds.client_secret, creds.link_password):
            assert secret not in argv
        ipc_dir = os.path.dirname(child.ref.address.removeprefix("ipc://"))
        assert stat.S_IMODE(os.stat(ipc_dir).st_mode) == 0o700
        # A peer on the same socket without the tree's password (or with CURVE) is not let in.
        ctx = zmq.Context()
        try:
            for mechanism in ("plain", "curve"):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if mechanism == "plain":
                    sock.setsockopt(zmq.PLAIN_USERNAME, creds.client_public)
                    sock.setsockopt(zmq.PLAIN_PASSWORD, b"guess")
                else:
                    peer = member()
                    sock.setsockopt(zmq.CURVE_SERVERKEY, peer.server_public)
                    sock.setsockopt(zmq.CURVE_PUBLICKEY, peer.client_public)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, peer.client_secret)
                sock.connect(child.ref.address)
                knock(
                    sock,
                    message(child.ref.name, Stop()),
                    message(child.ref.name, Echo("intruder"), ReplyTo("x", 1, None)),
                )
                assert await recv(sock, 1.0) is None
                sock.close()
        finally:
            ctx.term()
        assert await child.ref.ask(Echo("still"), timeout=10) == "still"
        assert alive(child.pid)


def test_serve_refuses_an_unusable_keys_directory(tmp_path, capsys):
    from sonar.cli.serve import main

    assert main(["--actor-keys", str(tmp_path / "missing")]) == 2
    assert "sonar actor keygen" in capsys.readouterr().err


class ForgedRef:
    """Encodes as an actor reference whose protocol names `tests.actors.tripwire`."""

    def __sonar_ref__(self) -> tuple[str, str | None, str]:
        return ("x", "ipc:///nowhere.sock", "tests.actors.tripwire:Protocol")


async def test_a_ref_naming_a_protocol_off_the_list_imports_nothing(deployment, tmp_path, monkeypatch):
    tripwire = tmp_path / "imported"
    monkeypatch.setenv("SONAR_TEST_TRIPWIRE", str(tripwire))
    address = free_tcp_address()
    proc = start_host(address, deployment)
    try:
        spec = SupervisorSpec("root", [ChildSpec("a", Sample, placement=Remote(address), ping_interval=None)])
        async with supervise(spec) as sup:
            ref = sup.child("a").ref
            with pytest.raises(ActorError, match="'tests.actors.tripwire:Protocol' is not on the allow-list"):
                await ref.ask(Tensors([ForgedRef()]), timeout=10)
            assert await ref.ask(Echo("ok"), timeout=10) == "ok"
        assert not tripwire.exists()
    finally:
        stop_host(proc)
