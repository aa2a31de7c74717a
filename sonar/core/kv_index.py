"""Which blocks each medium holds, as KV events announce them (the consumer's side of
``sonar.offload.events``).

Per medium, a reference count per block hash: each ``BlockStored`` listing a hash adds one, each
``BlockRemoved`` takes one, removals of unknown hashes are ignored, and ``AllBlocksCleared``
empties the medium (all media when it names none). Overlapping chunks and re-announcements are
then harmless.
"""

from __future__ import annotations

from collections.abc import Iterable

from sonar.core.events import MEDIUMS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["KVBlockIndex"]


class KVBlockIndex:
    """Which blocks each medium holds, from announcements (reference-counted per hash)."""

    def __init__(self) -> None:
        self.refs: dict[str, dict[bytes, int]] = {m: {} for m in MEDIUMS}
        self.ignored_removals = 0
        self.events = 0

    def apply(self, event: KVEvent) -> None:
        self.events += 1
        if isinstance(event, BlockStored):
            refs = self.refs.setdefault(event.medium, {})
            for h in event.block_hashes:
                refs[h] = refs.get(h, 0) + 1
        elif isinstance(event, BlockRemoved):
            refs = self.refs.setdefault(event.medium, {})
            for h in event.block_hashes:
                n = refs.get(h)
                if n is None:
                    self.ignored_removals += 1
                elif n <= 1:
                    del refs[h]
                else:
                    refs[h] = n - 1
        elif isinstance(event, AllBlocksCleared):
            for medium, refs in self.refs.items():
                if event.medium is None or event.medium == medium:
                    refs.clear()

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def blocks(self, medium: str) -> set[bytes]:
        return set(self.refs.get(medium, {}))

    def has(self, block_hash: bytes, medium: str | None = None) -> bool:
        media = self.refs.values() if medium is None else [self.refs.get(medium, {})]
        return any(block_hash in refs for refs in media)

    def summary(self) -> dict[str, int]:
        return {m: len(refs) for m, refs in self.refs.items()}
