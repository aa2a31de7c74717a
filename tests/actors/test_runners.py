"""A child named by path with its protocol: refs to it are made without importing its module, it
starts and answers in either placement, and a child process imports its module before hello."""

import subprocess
import sys

import pytest

from sonar.actors import ChildSpec, SupervisorSpec, allow, supervise
from sonar.actors.host import preload
from sonar.actors.runners import _protocol
from tests.actors.sample import Echo, SampleMsg

SAMPLE = "tests.actors.sample:Sample"


def test_the_protocol_given_leaves_the_module_unimported() -> None:
    code = (
        "import sys\n"
        "from sonar.actors import ChildSpec\n"
        "from sonar.actors.runners import _protocol\n"
        "from sonar.protocol.engine import WorkerMsg\n"
        "spec = ChildSpec('worker', 'sonar.engine.worker:WorkerActor', protocol=WorkerMsg)\n"
        "assert _protocol(spec) is WorkerMsg\n"
        "assert 'sonar.engine.worker' not in sys.modules and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert _protocol(ChildSpec("a", SAMPLE)) is SampleMsg  # without: read from the class


@pytest.mark.anyio
async def test_a_child_by_path_and_protocol_answers(placement) -> None:
    spec = SupervisorSpec("root", [ChildSpec("a", SAMPLE, protocol=SampleMsg, placement=placement, ping_interval=None)])
    async with supervise(spec) as sup:
        assert await sup.child("a").ref.ask(Echo("hi"), timeout=10) == "hi"


def test_preload_imports_only_modules_of_allowed_actors() -> None:
    assert not preload("tests.actors.helpers")  # no allowed actor class lives there
    assert "tests.actors.absent" not in sys.modules
    allow.allow_actor("tests.actors.absent:Nothing")
    assert not preload("tests.actors.absent")  # allowed, but it fails: the spawn reports that
    allow.allow_actor(SAMPLE)
    assert preload("tests.actors.sample")
