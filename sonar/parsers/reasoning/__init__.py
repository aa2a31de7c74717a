"""Reasoning parsers: separate a model's thinking (`reasoning_content`) from its answer.

Built in: `deepseek_r1` (thinks first, up to `</think>`; the opening `<think>` may be in the
prompt or the output), `qwen3` (`<think>...</think>` when the output or the prompt opens it; an
output that does not is all answer), `granite` ("Here is my thought process:" ... "Here is my
response:"). More register with `register_reasoning_parser` from a --reasoning-parser-plugin
file (see `sonar.parsers.plugins`).
"""

from __future__ import annotations

from typing import Callable

from sonar.parsers.plugins import ParserError
from sonar.parsers.reasoning.base import ReasoningFormat, ReasoningResult, ReasoningStream, split_reasoning


class DeepSeekR1Format(ReasoningFormat):
    name = "deepseek_r1"
    starts = ("<think>",)
    ends = ("</think>",)
    thinks_first = True


class Qwen3Format(ReasoningFormat):
    name = "qwen3"
    starts = ("<think>",)
    ends = ("</think>",)


class GraniteFormat(ReasoningFormat):
    name = "granite"
    starts = ("Here is my thought process:", "Here's my thought process:")
    ends = ("Here is my response:", "Here's my response:")


REASONING_PARSERS: dict[str, type[ReasoningFormat]] = {}
BUILTIN_REASONING_PARSERS = ("deepseek_r1", "granite", "qwen3")


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningFormat]], type[ReasoningFormat]]:
    """A class decorator: make the format available as --reasoning-parser `name`."""

    def register(cls: type[ReasoningFormat]) -> type[ReasoningFormat]:
        if not (isinstance(cls, type) and issubclass(cls, ReasoningFormat)):
            raise ParserError(f"reasoning parser {name!r}: {cls!r} is not a ReasoningFormat subclass")
        REASONING_PARSERS[name] = cls
        return cls

    return register


def reasoning_format(name: str) -> ReasoningFormat:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ParserError(f"unknown reasoning parser {name!r} (known: {', '.join(sorted(REASONING_PARSERS))})")
    return cls()


for _cls in (DeepSeekR1Format, Qwen3Format, GraniteFormat):
    register_reasoning_parser(_cls.name)(_cls)

__all__ = [
    "BUILTIN_REASONING_PARSERS",
    "REASONING_PARSERS",
    "DeepSeekR1Format",
    "GraniteFormat",
    "Qwen3Format",
    "ReasoningFormat",
    "ReasoningResult",
    "ReasoningStream",
    "reasoning_format",
    "register_reasoning_parser",
    "split_reasoning",
]
