"""`--help`, `--help=NAME` and `--help=all` for `sonar serve`.

* ``--help``: usage, the top-level options, and the list of groups.
* ``--help=all``: every group with every flag.
* ``--help=NAME``: a group named NAME (``CacheConfig``), else a flag named NAME (``max-model-len``,
  ``--max-model-len``, ``max_model_len``, ``-tp``, ``no-enable-prefix-caching``), else every group
  and flag whose name contains NAME (``prefix``). Case, dashes and underscores do not matter. No
  match is an error that suggests close names.
"""

from __future__ import annotations

import difflib
import textwrap
from typing import Any, Iterable

from sonar.cli.errors import UsageError
from sonar.cli.flags import Flag, Group, Kind, Status
from sonar.cli.table import FLAGS, GROUPS

WIDTH = 100
USAGE = "usage: python -m sonar serve [MODEL] [--FLAG VALUE ...] [--config FILE.yaml]"
INTRO = (
    "Serve MODEL through an OpenAI-compatible HTTP API. Without MODEL, Sonar serves its embedded "
    "SmolLM2-135M-Instruct. Every flag of the reference server is known: the ones Sonar does not "
    "implement yet are refused with a clear message unless given their default (or a value that means "
    "the same for Sonar)."
)
SEARCH_TIP = (
    "--help=NAME shows the group or flag named NAME, or all groups and flags whose name contains it "
    "(e.g. --help=CacheConfig, --help=max-model-len, --help=prefix); --help=all shows every flag."
)


def render_help(term: str) -> str:
    """The help text for ``--help`` (term "") or ``--help=term``; raises UsageError on no match."""
    term = term.strip()
    if not term:
        return _overview()
    if term.lower() == "all":
        return _join([USAGE, _wrap(INTRO, 0), _positional(), *(_group(g) for g in GROUPS)])
    key = _squash(term)
    for group in GROUPS:
        if _squash(group.name) == key:
            return _group(group) + "\n"
    exact = _flag_named(term)
    if exact is not None:
        return _join([f"{exact.group}:", _flag(exact)])
    groups = [g for g in GROUPS if key in _squash(g.name)]
    wanted = _normal(term)
    flags = [
        f
        for f in FLAGS.values()
        if f.group not in {g.name for g in groups} and any(wanted in _normal(o) for o in f.option_strings)
    ]
    if not groups and not flags:
        raise UsageError.bad(f"--help: no flag or group matches {term!r}{_suggest(term)}")
    parts = [f"Groups and flags whose name contains {term!r}:"]
    parts += [_group(g) for g in groups]
    parts += [_flag(f) for f in flags]
    return _join(parts)


def _overview() -> str:
    options = next(g for g in GROUPS if g.name == "options")
    width = max(len(g.name) for g in GROUPS) + 2
    lines = ["flag groups (--help=GROUP shows one):"]
    for group in GROUPS:
        if group is options:
            continue
        count = len(group.flags)
        text = f"{group.description} ({count} flag{'s' if count != 1 else ''})"
        lines.append(
            textwrap.fill(
                text,
                WIDTH,
                initial_indent="  " + group.name.ljust(width),
                subsequent_indent=" " * (width + 2),
                break_on_hyphens=False,
            )
        )
    return _join([USAGE, _wrap(INTRO, 0), _positional(), _group(options), "\n".join(lines), _wrap(SEARCH_TIP, 0)])


def _positional() -> str:
    return "positional arguments:\n" + _wrap("MODEL  the model to serve (the same as --model).", 2)


def _group(group: Group) -> str:
    head = [group.name if group.name != "options" else "options:", _wrap(group.description, 2)]
    return "\n".join(head) + "\n\n" + "\n\n".join(_flag(f) for f in group.flags)


def _flag(flag: Flag) -> str:
    lines = [
        textwrap.fill(_signature(flag), WIDTH, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
    ]
    lines.append(_wrap(flag.help, 6))
    if flag.choices is not None and flag.metavar is None:
        lines.append(_wrap("Choices: " + ", ".join(str(c) for c in flag.choices) + ".", 6))
    if flag.dotted:
        lines.append(_wrap(f"Also one key at a time: {flag.name}.KEY VALUE (or {flag.name}.KEY=VALUE).", 6))
    default = _default(flag)
    if default:
        lines.append(_wrap(default, 6))
    status = _status(flag)
    if status:
        lines.append(_wrap(status, 6))
    return "\n".join(lines)


def _signature(flag: Flag) -> str:
    if flag.kind is Kind.HELP:
        return "--help[=NAME], -h"
    names = [flag.name]
    if flag.kind is Kind.BOOL and flag.negatable:
        names.append(f"--no-{flag.name[2:]}")
    names += flag.aliases
    text = ", ".join(names)
    if flag.kind is Kind.BOOL:
        return text
    metavar = flag.display_metavar()
    if flag.kind in (Kind.LIST, Kind.INT_LIST):
        metavar = f"{metavar} [{metavar} ...]"
    return f"{text} {metavar}"


def _default(flag: Flag) -> str:
    if flag.kind is Kind.HELP:
        return ""
    if flag.default_note is not None:
        return f"Default: {flag.default_note}."
    return f"Default: {_format(flag.default)}."


def _format(value: Any) -> str:
    if value is None:
        return "unset"
    if value == "":
        return '""'
    if isinstance(value, tuple):
        return str(list(value))
    return str(value)


def _status(flag: Flag) -> str:
    status = flag.status
    if status is Status.IMPLEMENTED:
        if flag.supported is None:
            return ""
        return f"Sonar: implements {', '.join(map(str, flag.supported))}; the other values are not supported yet."
    accepted = [_accepted(flag, v) for v in flag.accepted_values()]
    if flag.kind is Kind.BOOL and {True, False} <= set(flag.accepted_values()):
        return f"Sonar: either value is accepted and means the same for Sonar: {flag.why}."
    why = f" ({flag.why})" if flag.why else ""
    return f"Sonar: not supported yet{why}; accepted only as {' or '.join(dict.fromkeys(accepted))}."


def _accepted(flag: Flag, value: Any) -> str:
    if value is None:
        return "unset"
    if flag.kind is Kind.BOOL:
        return flag.name if value else (f"--no-{flag.name[2:]}" if flag.negatable else "unset")
    return _format(value)


def _flag_named(term: str) -> Flag | None:
    wanted = _normal(term)
    for flag in FLAGS.values():
        names = {_normal(o) for o in flag.option_strings}
        if flag.kind is Kind.BOOL and flag.negatable:
            names.add("no-" + _normal(flag.name))
        if wanted in names:
            return flag
    return None


def _suggest(term: str) -> str:
    names = [_normal(f.name) for f in FLAGS.values()] + [g.name for g in GROUPS]
    close = difflib.get_close_matches(_normal(term), names, n=3, cutoff=0.6)
    return f" (close: {', '.join(close)})" if close else ""


def _normal(name: str) -> str:
    return name.strip().lstrip("-").lower().replace("_", "-")


def _squash(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _wrap(text: str, indent: int) -> str:
    pad = " " * indent
    return textwrap.fill(text, WIDTH, initial_indent=pad, subsequent_indent=pad, break_on_hyphens=False)


def _join(parts: Iterable[str]) -> str:
    return "\n\n".join(p.rstrip("\n") for p in parts if p) + "\n"
