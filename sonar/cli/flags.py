"""The shape of one `serve` flag and of a flag group; the table itself is in `sonar.cli.table`.

Every documented flag is known to the parser. What Sonar does with it is one of two things
(`Flag.status`), so that no flag is accepted and then ignored:

* ``implemented``: the value lands in `ServeConfig` or its `EngineConfig` (`target`). A flag may
  implement only some of its documented values (`supported`); the others fail as not supported.
* ``default-only``: Sonar does not have the feature yet. The documented default, and the values
  listed in `accepts` that mean the same for Sonar, are accepted; any other value stops the start
  with "sonar serve: --X is not supported yet", followed by `why` where the reason is not plain
  from the flag's name (it tunes a feature that another, refused, flag switches on; it concerns
  models Sonar does not serve).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable


class Kind(enum.Enum):
    """How a flag's value is written and parsed (see `sonar.cli.values`)."""

    BOOL = "bool"
    INT = "int"
    FLOAT = "float"
    STR = "str"
    HUMAN_INT = "human-int"  # 1k = 1000, 1K = 1024, 25.6k = 25600
    MODEL_LEN = "model-len"  # a human int, or auto / -1
    BYTES = "bytes"  # a human int, or a size with a byte unit (2G, 1.5GiB)
    JSON = "json"  # a JSON object (with `dotted`: also --flag.key value)
    LIST = "list"  # one or more strings (or one JSON list)
    INT_LIST = "int-list"  # one or more integers (or one JSON list)
    PLACEMENT = "placement"  # actor=where pairs, comma-separated
    HELP = "help"  # -h / --help[=NAME], handled before parsing


class Status(str, enum.Enum):
    IMPLEMENTED = "implemented"
    DEFAULT_ONLY = "default-only"


@dataclass(frozen=True)
class Flag:
    """One documented flag. `name` is the long option (``--max-num-seqs``)."""

    name: str
    group: str
    kind: Kind
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    negatable: bool = True
    """A BOOL flag with a ``--no-NAME`` form."""
    target: str | None = None
    """``engine.<field>``, ``serve.<field>``, ``model`` or ``config``: where an implemented value goes
    (``parse``: the parser checks it against other flags and keeps nothing)."""
    supported: tuple[Any, ...] | None = None
    """For an implemented flag: the values Sonar implements (None: all valid values)."""
    why: str | None = None
    """For a default-only flag: why Sonar refuses its other values (shown in the error and in help)."""
    accepts: tuple[Any, ...] = ()
    """For a default-only flag: values besides the default that mean the same for Sonar."""
    value_aliases: dict[str, Any] = field(default_factory=dict)
    """Spellings that mean the same value (``half`` -> ``float16``)."""
    dotted: bool = False
    """A JSON flag that also takes one key at a time: ``--flag.key value``, ``--flag.a.b=value``."""
    extend: bool = False
    """A LIST flag that may be repeated, each use adding to the list."""
    check: Callable[[Any], None] | None = None
    """Raises ValueError when a converted value is out of range."""
    metavar: str | None = None
    reference_default: Any = None
    """Set only where Sonar's default differs on purpose from the documented one."""
    default_note: str | None = None
    """Shown in help next to the default (e.g. what the engine picks when unset)."""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def status(self) -> Status:
        if self.target is not None:
            return Status.IMPLEMENTED
        return Status.DEFAULT_ONLY

    def accepted_values(self) -> tuple[Any, ...]:
        """For a default-only flag: the values it accepts (the default first)."""
        return (self.default, *self.accepts)

    def display_metavar(self) -> str:
        if self.metavar is not None:
            return self.metavar
        return self.dest.upper()


@dataclass(frozen=True)
class Group:
    """A titled group of flags, as `--help=<group>` shows it."""

    name: str
    description: str
    flags: tuple[Flag, ...]
