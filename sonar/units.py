"""Human-readable integers and memory sizes for command-line flags and config files.

Two families of suffixes:

* ``parse_human_int`` (``--max-num-batched-tokens``, ``--max-model-len``,
  ``--kv-cache-memory-bytes`` ...): a lowercase suffix is a power of 1000 (``1k`` = 1000,
  ``1m`` = 10**6, ``1g`` = 10**9, ``1t`` = 10**12), an uppercase one a power of 1024
  (``1K`` = 1024, ``1M`` = 2**20, ``1G`` = 2**30, ``1T`` = 2**40). A fractional number is
  allowed with a decimal suffix only (``25.6k`` = 25600) and must give a whole number.
* ``parse_memory_size`` accepts all of the above with the same meaning, plus explicit byte
  units: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000) and ``KiB``/``MiB``/``GiB``/``TiB``
  (powers of 1024), case-insensitive, optionally separated by a space (``1.5 GiB``). A
  fractional size is rounded down to whole bytes.

Numbers are computed with exact decimal arithmetic, so ``25.6k`` is 25600, never 25599.
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = [
    "AUTO_MAX_MODEL_LEN",
    "format_memory_size",
    "parse_human_int",
    "parse_max_model_len",
    "parse_memory_size",
]

AUTO_MAX_MODEL_LEN = -1
"""What ``parse_max_model_len`` returns for ``auto`` / ``-1``: fit the length to the KV cache."""

_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_HUMAN_INT_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?)(?P<suffix>[kmgtKMGT]?)")
_MEMORY_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)")


def _reject_non_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"invalid {what} {value!r}: expected an int or a string such as '32k'")


def parse_human_int(value: str | int) -> int:
    """Parse a non-negative integer written as ``8192``, ``32k``, ``25.6k``, ``1K`` or ``2M``.

    Raises ``ValueError`` naming the offending value when it cannot be parsed, is negative,
    uses a fraction with a binary (uppercase) suffix, or does not come out whole.
    """
    _reject_non_int(value, "integer")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid integer {value!r}: must not be negative")
        return value
    text = value.strip()
    match = _HUMAN_INT_RE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"invalid human-readable integer {value!r}: expected digits with an optional "
            "suffix k/m/g/t (powers of 1000) or K/M/G/T (powers of 1024), e.g. '32k' or '1K'"
        )
    number, suffix = match.group("num"), match.group("suffix")
    if not suffix:
        if "." in number:
            raise ValueError(f"invalid integer {value!r}: a fraction needs a suffix such as 'k'")
        return int(number)
    if suffix in _BINARY_SUFFIXES:
        if "." in number:
            raise ValueError(
                f"invalid human-readable integer {value!r}: fractions are allowed only with "
                f"decimal suffixes; did you mean '{number}{suffix.lower()}'?"
            )
        return int(number) * _BINARY_SUFFIXES[suffix]
    exact = Decimal(number) * _DECIMAL_SUFFIXES[suffix]
    if exact != exact.to_integral_value():
        raise ValueError(f"invalid human-readable integer {value!r}: {exact} is not a whole number")
    return int(exact)


def parse_max_model_len(value: str | int) -> int:
    """Parse ``--max-model-len``: a positive human-readable integer, or ``auto`` / ``-1``.

    ``auto`` and ``-1`` return ``AUTO_MAX_MODEL_LEN`` (-1): the server picks the model's
    context length if it fits in the KV cache, else the largest length that does.
    """
    _reject_non_int(value, "max model length")
    if isinstance(value, str) and value.strip().lower() in ("auto", "-1"):
        return AUTO_MAX_MODEL_LEN
    if value == AUTO_MAX_MODEL_LEN:
        return AUTO_MAX_MODEL_LEN
    try:
        length = parse_human_int(value)
    except ValueError as exc:
        raise ValueError(f"invalid max model length {value!r}: {exc}; or use 'auto'") from None
    if length == 0:
        raise ValueError(f"invalid max model length {value!r}: must be positive, or 'auto'")
    return length


def parse_memory_size(value: str | int) -> int:
    """Parse a size in bytes: ``1073741824``, ``2G``, ``512M``, ``1.5GiB``, ``8 GB``, ``64KiB``.

    Single-letter suffixes follow ``parse_human_int`` (``2G`` = 2 GiB, ``2g`` = 2 * 10**9);
    ``KB``/``MB``/``GB``/``TB`` are powers of 1000 and ``KiB``/``MiB``/``GiB``/``TiB`` powers of
    1024, in any letter case. Fractions are allowed with every unit and rounded down to
    whole bytes.
    """
    _reject_non_int(value, "memory size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid memory size {value!r}: must not be negative")
        return value
    match = _MEMORY_RE.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"invalid memory size {value!r}: expected a number with an optional unit, "
            "e.g. '2G', '1.5GiB', '512MB' or '1073741824'"
        )
    number, unit = match.group("num"), match.group("unit")
    if unit == "" or (len(unit) == 1 and unit in "kmgtKMGT"):
        multiplier = 1 if unit == "" else (_DECIMAL_SUFFIXES | _BINARY_SUFFIXES)[unit]
    else:
        try:
            multiplier = _BYTE_UNITS[unit.lower()]
        except KeyError:
            raise ValueError(
                f"invalid memory size {value!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB, "
                "KiB, MiB, GiB, TiB or one of k/m/g/t/K/M/G/T"
            ) from None
    return int(Decimal(number) * multiplier)


def format_memory_size(num_bytes: int) -> str:
    """Render a byte count for logs: ``1.50 GiB``, ``512.00 MiB``, ``100 B``."""
    if num_bytes < 0:
        raise ValueError(f"invalid memory size {num_bytes!r}: must not be negative")
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"
