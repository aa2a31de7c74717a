"""`Replay`: a request moved off a lost replica is replayed whole elsewhere, and the client gets
only what it did not have (tokens, text, logprobs, prompt logprobs), or an error when the replay
does not repeat what was sent."""

import pytest

from sonar.engine.replay import Replay
from sonar.errors import EngineDeadError
from sonar.protocol.engine import OutputDelta, PositionLogprobs


def _lp(token: int) -> PositionLogprobs:
    return PositionLogprobs(token, f"t{token}", -0.5, 1, [])


def _delta(tokens: list[int], text: str, finish: str | None = None, prompt: int = 0) -> OutputDelta:
    return OutputDelta(
        "r",
        text,
        tokens,
        finish_reason=finish,
        logprobs=[_lp(t) for t in tokens],
        prompt_logprobs=[None, *(_lp(i) for i in range(prompt - 1))] if prompt else None,
    )


def test_a_request_never_moved_passes_through() -> None:
    replay = Replay()
    delta = _delta([1, 2], " a b", prompt=3)
    assert replay.take(delta) is delta
    assert (replay.tokens, replay.text_len, replay.prompt_sent) == ([1, 2], 4, 3)


def test_a_replay_sends_only_what_follows_what_the_client_has() -> None:
    replay = Replay()
    replay.take(_delta([5], " x", prompt=3))
    replay.take(_delta([6, 7], " y z"))
    replay.restart()
    assert replay.take(_delta([5], " x", prompt=3)) is None  # prompt logprobs and the first token: sent
    crossing = replay.take(_delta([6, 7, 8], " y z w"))  # two repeated, one new (a speculative step)
    assert crossing is not None
    assert (crossing.token_ids, crossing.text, [lp.token_id for lp in crossing.logprobs]) == ([8], " w", [8])
    assert crossing.prompt_logprobs is None
    last = replay.take(_delta([9], " v", finish="length"))
    assert last is not None and (last.token_ids, last.text, last.finish_reason) == ([9], " v", "length")
    assert replay.tokens == [5, 6, 7, 8, 9] and not replay.replaying


def test_a_replay_moved_again_before_it_caught_up_still_skips_the_sent_tokens() -> None:
    replay = Replay()
    replay.take(_delta([1, 2, 3], " a b c"))
    replay.restart()
    assert replay.take(_delta([1], " a")) is None
    replay.restart()
    delta = replay.take(_delta([1, 2, 3, 4], " a b c d"))
    assert delta is not None and (delta.token_ids, delta.text) == ([4], " d")


def test_a_replay_that_does_not_repeat_the_sent_tokens_ends_the_request() -> None:
    replay = Replay()
    replay.take(_delta([1, 2], " a b"))
    replay.restart()
    with pytest.raises(EngineDeadError, match="did not repeat the tokens already sent"):
        replay.take(_delta([1, 9], " a q"))
    early = Replay()
    early.take(_delta([1, 2], " a b"))
    early.restart()
    with pytest.raises(EngineDeadError):
        early.take(_delta([1], " a", finish="stop"))


def test_a_request_moved_before_its_first_token_is_sent_whole() -> None:
    replay = Replay()
    replay.restart()
    delta = replay.take(_delta([4], " d", prompt=2))
    assert delta is not None and delta.token_ids == [4] and delta.prompt_logprobs is not None
