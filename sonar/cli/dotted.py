"""One key at a time for JSON-valued flags: ``--override-generation-config.temperature 0.5``.

A flag documented as taking "a JSON string or JSON keys passed individually" (`Flag.dotted`) also
accepts ``--FLAG.KEY VALUE`` and ``--FLAG.KEY=VALUE``, with the same for its short alias
(``-cc.mode=3`` is ``-cc '{"mode": 3}'``). Dots go deeper (``--FLAG.a.b 1`` is
``{"a": {"b": 1}}``). VALUE is read as JSON when it parses (``3``, ``true``, ``[1, 2]``), else kept as
text. The keys are merged over the flag's JSON value, whether that came from the command line or
from the config file; a later key replaces an earlier one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sonar.cli.errors import UsageError
from sonar.cli.flags import Flag
from sonar.cli.values import parse_dotted_value

_DOTTED = re.compile(r"(?P<opt>--?[A-Za-z][\w-]*)\.(?P<path>[^=]+)(?:=(?P<value>.*))?", re.DOTALL)


@dataclass(frozen=True)
class DottedKey:
    flag: Flag
    path: tuple[str, ...]
    value: Any


def split_dotted(argv: list[str], by_option: dict[str, Flag]) -> tuple[list[str], list[DottedKey]]:
    """Take the ``--FLAG.KEY VALUE`` words out of `argv`; return the other words and the keys."""
    rest: list[str] = []
    keys: list[DottedKey] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            rest.extend(argv[i:])
            break
        match = _DOTTED.fullmatch(word) if word.startswith("-") else None
        flag = by_option.get(match.group("opt")) if match else None
        if match is None or flag is None:
            rest.append(word)
            i += 1
            continue
        option = match.group("opt")
        if not flag.dotted:
            raise UsageError.bad(f"argument {option}: takes a whole JSON value, not {option}.KEY")
        path = tuple(match.group("path").split("."))
        if any(not part for part in path):
            raise UsageError.bad(f"argument {option}: empty key in {word.split('=', 1)[0]!r}")
        text = match.group("value")
        if text is None:
            if i + 1 >= len(argv):
                raise UsageError.bad(f"argument {word}: expected one value")
            text = argv[i + 1]
            i += 1
        keys.append(DottedKey(flag, path, parse_dotted_value(text)))
        i += 1
    return rest, keys


def merge_key(target: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``target[path[0]][path[1]]... = value``, creating (or replacing non-dict) levels."""
    node = target
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value
