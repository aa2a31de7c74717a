import pytest

from sonar.actors import parse_placement


@pytest.fixture(params=["inprocess", "process"])
def placement(request):
    """Each runtime scenario runs with the actor in this process and in a child process."""
    return parse_placement(request.param)


@pytest.fixture
def deployment(tmp_path):
    """A deployment's keys, as `python -m sonar actor keygen DIR` writes them, used by this process."""
    import subprocess
    import sys

    from sonar.actors import keys

    root = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "sonar", "actor", "keygen", str(root), "--name", "tests"],
        check=True,
        capture_output=True,
    )
    keys.configure(root)
    yield root
    keys.configure(None)
