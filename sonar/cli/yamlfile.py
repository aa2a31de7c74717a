"""`--config FILE.yaml`: flag values read from a YAML mapping.

Keys are flag names without the leading dashes, with dashes or underscores (``max-num-seqs`` or
``max_num_seqs``), plus ``model``. Values are YAML scalars, lists or mappings and are checked like
command-line values. A JSON flag may also be set one key at a time (``compilation-config.mode: 3``).
An unknown key is an error naming it.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from sonar.cli.dotted import DottedKey
from sonar.cli.errors import UsageError
from sonar.cli.flags import Flag, Kind
from sonar.cli.values import convert


def load_config_file(path: str, by_dest: dict[str, Flag]) -> tuple[dict[str, Any], list[DottedKey]]:
    """Read `path`; return {flag name: typed value} and the dotted JSON keys it sets."""
    import yaml  # lazily: only needed with --config

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError.bad(f"argument --config: cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise UsageError.bad(f"argument --config: {path}: not valid YAML ({first})") from None
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        raise UsageError.bad(f"argument --config: {path}: expected a mapping of flag names to values")

    values: dict[str, Any] = {}
    keys: list[DottedKey] = []
    for raw_key, raw_value in data.items():
        key = str(raw_key).strip()
        if raw_value is None:  # `key:` with no value leaves the flag at its default
            continue
        base, dot, rest = key.partition(".")
        flag = by_dest.get(base.lstrip("-").replace("-", "_"))
        where = f"config file {path}"
        if flag is None or flag.kind is Kind.HELP:
            raise UsageError.bad(f"{where}: unknown key {key!r}{_suggest(base, by_dest)}")
        if flag.target == "config":
            raise UsageError.bad(f"{where}: key {key!r}: a config file cannot name another config file")
        if dot:
            if not flag.dotted:
                raise UsageError.bad(f"{where}: key {key!r}: {flag.name} takes a whole JSON object, not keys")
            path_parts = tuple(rest.split("."))
            if any(not part for part in path_parts):
                raise UsageError.bad(f"{where}: key {key!r}: empty part in the dotted key")
            keys.append(DottedKey(flag, path_parts, raw_value))
            continue
        try:
            values[flag.name] = convert(flag, raw_value)
        except ValueError as exc:
            raise UsageError.bad(f"{where}: key {key!r}: {exc}") from None
    return values, keys


def _suggest(key: str, by_dest: dict[str, Flag]) -> str:
    wanted = key.lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(wanted, list(by_dest), n=1, cutoff=0.75)
    return f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
