from __future__ import annotations

import pytest

from sonar.cli import UsageError, parse_serve_args


@pytest.fixture
def usage_error():
    """Parse argv expecting a UsageError; return its one-line message."""

    def run(*argv: str) -> str:
        with pytest.raises(UsageError) as info:
            parse_serve_args(list(argv))
        message = str(info.value)
        assert "\n" not in message
        return message

    return run
