"""The chaos package's shared server."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.chaos.helpers import ENGINE_ARGS
from tests.http.conftest import ServerProcess, serving


@pytest.fixture(scope="package")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with `ENGINE_ARGS` and no fault injected, for the modules that need nothing else
    (test_disconnect_storm, test_recovery): starting one costs seconds. What a test does to it
    (a storm of cut requests, a killed worker) must leave it serving, which the tests check; it
    must stop on SIGTERM with exit code 0."""
    with serving(tmp_path_factory.mktemp("plain"), *ENGINE_ARGS) as server:
        yield server
