"""Sleep mode's transitions as plain values (`sonar.core.sleep`)."""

from __future__ import annotations

import pytest

from sonar.core.sleep import AWAKE, TAGS, SleepRefusedError, SleepState, plan_sleep, plan_wake
from sonar.errors import InvalidRequestError


def test_sleep_puts_every_tag_to_sleep_at_its_level() -> None:
    assert plan_sleep(AWAKE, 1) == SleepState(1, TAGS)
    assert plan_sleep(AWAKE, 2) == SleepState(2, ("weights", "kv_cache"))
    assert plan_sleep(SleepState(2, TAGS), 2) is None  # again: nothing to do


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_a_level_other_than_1_or_2_is_refused(level: object) -> None:
    with pytest.raises(InvalidRequestError, match="sleep level must be 1 or 2") as info:
        plan_sleep(AWAKE, level)  # type: ignore[arg-type]
    assert info.value.param == "level"


def test_sleeping_at_another_level_or_half_awake_is_refused() -> None:
    with pytest.raises(SleepRefusedError, match="asleep at level 1"):
        plan_sleep(SleepState(1, TAGS), 2)
    with pytest.raises(SleepRefusedError, match="kv_cache asleep"):
        plan_sleep(SleepState(2, ("kv_cache",)), 2)


def test_wake_by_tags_weights_first() -> None:
    asleep = SleepState(2, TAGS)
    assert plan_wake(asleep) == (AWAKE, TAGS)
    assert plan_wake(asleep, ["kv_cache", "weights"]) == (AWAKE, ("weights", "kv_cache"))
    half, waking = plan_wake(asleep, ["weights"])
    assert (half, waking) == (SleepState(2, ("kv_cache",)), ("weights",)) and half.is_sleeping
    assert plan_wake(half, ["weights"]) == (half, ())  # awake already: nothing wakes
    assert plan_wake(half, ["kv_cache"]) == (AWAKE, ("kv_cache",))
    assert plan_wake(AWAKE) == (AWAKE, ())


@pytest.mark.parametrize(("tags", "message"), [(["kv"], "unknown wake-up tag 'kv'"), ([], "no wake-up tag given")])
def test_unknown_or_no_tags_are_refused(tags: list[str], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        plan_wake(SleepState(1, TAGS), tags)
    assert info.value.param == "tags"
