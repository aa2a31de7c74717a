"""What the `serve` parser raises instead of exiting, so callers (and tests) decide what to do."""

from __future__ import annotations

from sonar.errors import SonarError

PROG = "sonar serve"


class UsageError(SonarError):
    """The command line (or config file) is wrong. `str(error)` is the one line to print."""

    exit_code = 2

    @classmethod
    def bad(cls, message: str) -> "UsageError":
        """An argparse-style error: ``sonar serve: error: <message>``."""
        return cls(f"{PROG}: error: {message}")

    @classmethod
    def unsupported(cls, option: str, detail: str = "", why: str | None = None) -> "UsageError":
        """``sonar serve: --X is not supported yet`` (plus a detail in parentheses, then why)."""
        suffix = f" ({detail})" if detail else ""
        reason = f": {why}" if why else ""
        return cls(f"{PROG}: {option} is not supported yet{suffix}{reason}")


class HelpRequested(SonarError):
    """`-h` / `--help[=NAME]` was given; `text` is what to print, then exit 0."""

    exit_code = 0

    def __init__(self, text: str) -> None:
        super().__init__("help requested")
        self.text = text
