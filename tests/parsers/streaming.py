"""Run a tool-call format both ways (whole text; streamed in random pieces) and compare."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from sonar.parsers.tools import ToolCallFormat, ToolCallStream, parse_tool_calls


@dataclass
class Streamed:
    content: str
    calls: list[tuple[str, str]]  # (name, arguments)
    ids: list[str]


def stream(fmt: ToolCallFormat, pieces: list[str]) -> Streamed:
    s = ToolCallStream(fmt)
    content, names, args, ids = "", {}, {}, {}
    for delta in [*(s.feed(p) for p in pieces), s.finish()]:
        content += delta.content
        for d in delta.calls:
            if d.id is not None:
                assert d.index not in ids and d.index == len(ids), "a call starts once, in order"
                assert d.id.startswith("call_") and d.name
                ids[d.index], names[d.index], args[d.index] = d.id, d.name, ""
            else:
                assert d.name is None and d.arguments
            args[d.index] += d.arguments or ""
    return Streamed(content, [(names[i], args[i]) for i in sorted(names)], [ids[i] for i in sorted(ids)])


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        pieces.append(text[i : i + n])
        i += n
    return pieces


def check_both_ways(fmt: ToolCallFormat, text: str, seeds: int = 12) -> tuple[str | None, list[tuple[str, str]]]:
    """The whole-text result (content, [(name, arguments)]), after checking that streaming the
    text in characters, in one piece and in random pieces hands out exactly the same."""
    whole = parse_tool_calls(fmt, text)
    calls = [(c.name, c.arguments) for c in whole.calls]
    assert len({c.id for c in whole.calls}) == len(calls)
    splits = [list(text), [text], *(random_pieces(text, seed) for seed in range(seeds))]
    for pieces in splits:
        got = stream(fmt, pieces)
        assert (got.content or None, got.calls) == (whole.content, calls), pieces
    return whole.content, calls


def args(arguments: str) -> object:
    return json.loads(arguments)
