import pytest

from sonar.actors import parse_placement


@pytest.fixture(params=["inprocess", "process"])
def placement(request):
    """The manager runs in this process and in a child process."""
    return parse_placement(request.param)
