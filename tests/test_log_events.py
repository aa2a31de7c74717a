"""Sonar's log events are dotted names with fields (`actor.restart actor=worker restarts=1`), so
they can be searched and counted; prose goes into a `detail=` field. Every logger call in
`sonar/` whose event is a literal string is checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sonar"
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
EVENT = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)+")


def _events() -> list[tuple[str, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "log"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", node.args[0].value))
    return found


def test_every_log_event_is_a_dotted_name() -> None:
    events = _events()
    assert len(events) > 50  # the walk found the calls
    prose = [f"{where}: {event!r}" for where, event in events if not EVENT.fullmatch(event)]
    assert prose == [], "log events that are not dotted names:\n" + "\n".join(prose)
