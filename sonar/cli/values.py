"""Turning a flag's raw value (command-line text, or a YAML scalar/list/mapping) into its typed value.

`convert(flag, raw)` is the one entry point: it parses by `flag.kind`, maps value aliases,
enforces `choices` and the flag's own `check`, and raises `ValueError` with a message meant to
follow "argument --flag: ".
"""

from __future__ import annotations

import json
from typing import Any

from sonar.cli.flags import Flag, Kind
from sonar.units import parse_human_int, parse_max_model_len, parse_memory_size

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def convert(flag: Flag, raw: Any) -> Any:
    """The typed value of `flag` for `raw`; None stays None (unset)."""
    if raw is None:
        return None
    if flag.kind in (Kind.LIST, Kind.INT_LIST):
        value: Any = tuple(_element(flag, item) for item in _as_list(raw))
    else:
        value = _scalar(flag, raw)
    if flag.check is not None and value is not None:
        flag.check(value)
    return value


def convert_element(flag: Flag, raw: str) -> Any:
    """One command-line word of a LIST / INT_LIST flag (a JSON list is unpacked later)."""
    if flag.kind is Kind.INT_LIST and not raw.lstrip().startswith("["):
        return _element(flag, raw)
    return raw


def _as_list(raw: Any) -> list[Any]:
    if isinstance(raw, (list, tuple, set, frozenset)):
        items = list(raw)
        if len(items) == 1 and isinstance(items[0], str) and items[0].lstrip().startswith("["):
            return _as_list(items[0])
        return items
    if isinstance(raw, str) and raw.lstrip().startswith("["):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON list {raw!r}: {exc.msg}") from None
        if not isinstance(parsed, list):
            raise ValueError(f"expected a JSON list, got {raw!r}")
        return parsed
    return [raw]


def _element(flag: Flag, item: Any) -> Any:
    if flag.kind is Kind.INT_LIST:
        value: Any = _int(item)
    else:
        if isinstance(item, (dict, list)):
            raise ValueError(f"expected a string, got {item!r}")
        value = str(item)
    return _choose(flag, value)


def _scalar(flag: Flag, raw: Any) -> Any:
    kind = flag.kind
    if isinstance(raw, str) and flag.choices is not None and raw == "None" and None in flag.choices:
        return None
    if kind is Kind.BOOL:
        return _bool(raw)
    if kind is Kind.INT:
        return _choose(flag, _int(raw))
    if kind is Kind.FLOAT:
        return _choose(flag, _float(raw))
    if kind is Kind.STR:
        if isinstance(raw, (dict, list, tuple)):
            raise ValueError(f"expected a string, got {raw!r}")
        if isinstance(raw, bool):
            raise ValueError(f"expected a string, got {raw!r}")
        return _choose(flag, str(raw))
    if kind is Kind.HUMAN_INT:
        _no_bool(raw)
        return parse_human_int(raw if isinstance(raw, (int, str)) else str(raw))
    if kind is Kind.MODEL_LEN:
        _no_bool(raw)
        return parse_max_model_len(raw if isinstance(raw, (int, str)) else str(raw))
    if kind is Kind.BYTES:
        _no_bool(raw)
        return parse_memory_size(raw if isinstance(raw, (int, str)) else str(raw))
    if kind is Kind.JSON:
        return _json_object(raw)
    if kind is Kind.PLACEMENT:
        return parse_placement_map(raw)
    raise ValueError(f"{flag.name} takes no value")


def _choose(flag: Flag, value: Any) -> Any:
    if isinstance(value, str) and value in flag.value_aliases:
        value = flag.value_aliases[value]
    if flag.choices is not None and value not in flag.choices:
        shown = ", ".join(str(c) for c in flag.choices)
        raise ValueError(f"invalid choice: {value!r} (choose from {shown})")
    return value


def _no_bool(raw: Any) -> None:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"expected true or false, got {raw!r}")


def _int(raw: Any) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise ValueError(f"expected an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {raw!r}") from None


def _float(raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"expected a number, got {raw!r}")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"expected a number, got {raw!r}") from None


def _json_object(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    if not isinstance(raw, str):
        raise ValueError(f"expected a JSON object, got {raw!r}")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON {raw!r}: {exc.msg} at column {exc.colno}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"expected a JSON object such as '{{\"key\": 1}}', got {raw!r}")
    return parsed


def parse_dotted_value(text: str) -> Any:
    """The value of one ``--flag.key VALUE``: JSON when it parses as JSON, else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_placement_map(raw: Any) -> dict[str, str]:
    """``worker=process,detokenizer=inprocess`` (or a mapping) -> {actor: where}, checked."""
    from sonar.actors.spec import parse_placement
    from sonar.engine.config import ACTORS

    if isinstance(raw, dict):
        pairs = [(str(k), str(v)) for k, v in raw.items()]
    elif isinstance(raw, str):
        pairs = []
        for part in raw.split(","):
            if not part.strip():
                continue
            actor, sep, where = part.partition("=")
            if not sep:
                raise ValueError(f"expected actor=where pairs such as 'worker=process', got {part.strip()!r}")
            pairs.append((actor.strip(), where.strip()))
    else:
        raise ValueError(f"expected actor=where pairs, got {raw!r}")
    placement: dict[str, str] = {}
    for actor, where in pairs:
        if actor not in ACTORS:
            raise ValueError(f"unknown actor {actor!r} (one of {', '.join(ACTORS)})")
        parse_placement(where)
        placement[actor] = where
    return placement


# Range checks used by the table.


def positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")


def non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")


def port_number(value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"a port must be in 0..65535, got {value}")


def fraction(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"must be a fraction in (0, 1], got {value}")


def otlp_endpoint(value: str) -> None:
    from sonar.http.tracing import TracingConfigError, traces_url  # the OpenTelemetry SDK stays unloaded

    try:
        traces_url(value)
    except TracingConfigError as exc:
        raise ValueError(str(exc)) from None


def watermark(value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {value}")


def logprobs_cap(value: int) -> None:
    if value < -1:
        raise ValueError(f"must be -1 (no cap) or >= 0, got {value}")


def power_of_two(value: int) -> None:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"must be a positive power of two, got {value}")


def structured_outputs_config(value: dict[str, Any]) -> None:
    from sonar.structured.config import StructuredOutputsConfig

    StructuredOutputsConfig.parse(value)


def profiler_config(value: dict[str, Any]) -> None:
    from sonar.engine.profiler import ProfilerConfig

    ProfilerConfig.parse(value)


def eplb_config(value: dict[str, Any]) -> None:
    from sonar.core.eplb import EplbConfig

    EplbConfig.parse(value)


def weight_transfer_config(value: dict[str, Any]) -> None:
    from sonar.core.weights import WeightTransferConfig

    WeightTransferConfig.parse(value)
