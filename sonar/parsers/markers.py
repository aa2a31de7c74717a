"""Text markers that may arrive in pieces."""

from __future__ import annotations

from typing import Sequence


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers` (a stream
    holds them back until it knows)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
