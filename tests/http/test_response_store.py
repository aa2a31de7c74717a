"""The bounded response store: eviction by count and by bytes, oldest first; plain values, no server."""

from __future__ import annotations

import random

import msgspec
import pytest

from sonar.http.response_store import ResponseStore

TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def size(response: bytes, conversation: list) -> int:
    return len(response) + len(msgspec.json.encode(conversation))


def test_keeps_and_returns_what_was_put() -> None:
    store = ResponseStore(4, 10_000)
    assert store.put("a", b'{"id":"a"}', TURN) == []
    got = store.get("a")
    assert got is not None and got.response == b'{"id":"a"}' and got.conversation == TURN
    assert "a" in store and len(store) == 1 and store.bytes == size(b'{"id":"a"}', TURN)
    assert store.get("b") is None
    store.check_invariants()


def test_the_oldest_is_evicted_past_the_count() -> None:
    store = ResponseStore(3, 10_000)
    for name in "abc":
        assert store.put(name, b"{}", TURN) == []
    assert store.put("d", b"{}", TURN) == ["a"]
    assert [x in store for x in "abcd"] == [False, True, True, True]
    store.check_invariants()


def test_the_oldest_are_evicted_until_the_bytes_fit() -> None:
    one = size(b"{}", TURN)
    store = ResponseStore(100, 3 * one)
    for name in "abc":
        store.put(name, b"{}", TURN)
    big = b"x" * (2 * one - len(msgspec.json.encode(TURN)))  # as big as two small ones
    assert store.put("big", big, TURN) == ["a", "b"]
    assert store.bytes == 3 * one and [x in store for x in ("c", "big")] == [True, True]
    store.check_invariants()


def test_a_response_bigger_than_the_bound_is_not_kept_and_evicts_nothing() -> None:
    store = ResponseStore(10, 200)
    store.put("a", b"{}", TURN)
    assert store.put("huge", b"x" * 500, TURN) == []
    assert "huge" not in store and "a" in store
    store.check_invariants()


def test_zero_keeps_nothing() -> None:
    store = ResponseStore(0, 10_000)
    assert store.put("a", b"{}", TURN) == [] and "a" not in store


def test_delete_and_put_again_free_their_bytes() -> None:
    store = ResponseStore(10, 10_000)
    store.put("a", b"{}", TURN)
    store.put("a", b'{"again":1}', TURN)  # the same id replaces its entry
    assert len(store) == 1 and store.bytes == size(b'{"again":1}', TURN)
    assert store.delete("a") is True and store.delete("a") is False
    assert len(store) == 0 and store.bytes == 0


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        ResponseStore(-1, 10)


def test_random_operations_keep_the_bounds() -> None:
    rng = random.Random(7)
    store = ResponseStore(5, 2_000)
    order: list[str] = []  # what the store should hold, oldest first
    for step in range(2_000):
        key = f"r{rng.randrange(12)}"
        if rng.random() < 0.2:
            assert store.delete(key) == (key in order)
            if key in order:
                order.remove(key)
        else:
            body = b"x" * rng.randrange(0, 900)
            evicted = store.put(key, body, TURN)
            if key in order:
                order.remove(key)
            assert evicted == order[: len(evicted)]
            order = order[len(evicted) :]
            if size(body, TURN) <= store.max_bytes:
                order.append(key)
        assert [k for k in order if k in store] == order and len(store) == len(order)
        store.check_invariants()
