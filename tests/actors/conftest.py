import pytest

from sonar.actors import parse_placement


@pytest.fixture(params=["inprocess", "process"])
def placement(request):
    """Each runtime scenario runs with the actor in this process and in a child process."""
    return parse_placement(request.param)


