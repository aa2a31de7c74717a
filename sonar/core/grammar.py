"""What the scheduler core needs of a request's grammar matcher (structured outputs).

A request that constrains its output (`SamplingParams.structured_outputs`) carries one
`GrammarMatcher` (`Request.grammar`), built by a backend in `sonar.structured` from the compiled
grammar. The core advances it in ``update_from_output`` with exactly the tokens the request keeps,
and with nothing else: the matcher never runs ahead of the request's tokens, so preemption,
recompute, async placeholders and a worker restart need no rollback (a recomputed request samples
its next token from the state its kept tokens left). Speculative decoding only looks ahead:
``valid_prefix`` cuts a request's drafts to what its grammar allows, and the shell steps through
the drafts to fill each draft row's bitmask, then rolls them back. The shell asks it for the packed bitmask of
the tokens allowed next, one int32 row per request (bit ``t % 32`` of word ``t // 32`` set: token
``t`` allowed), which the worker applies to the logits before sampling.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["GrammarMatcher"]


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the request then
        fails: a backend may leave the matcher unusable)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted its stop token, or nothing can follow)."""
        ...

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 ``[rows, ceil(vocab / 32)]``
        CPU tensor."""
        ...

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar would accept in a row from its state now, which is
        left as it was (speculative decoding: drafts past that are dropped)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (the drafts the shell stepped through to fill
        their rows' bitmasks)."""
        ...
