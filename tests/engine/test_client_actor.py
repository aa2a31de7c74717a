"""DeltaStream: a request's outputs reach its reader in order, with a wait only while none is there."""

from __future__ import annotations

import anyio
import pytest

from sonar.engine.client_actor import DeltaStream

pytestmark = pytest.mark.anyio


async def test_items_sent_before_the_read_come_out_in_order() -> None:
    stream = DeltaStream()
    for item in ("a", "b", "c"):
        stream.send_nowait(item)
    assert [await stream.receive() for _ in range(3)] == ["a", "b", "c"]


async def test_a_reader_waits_until_an_item_is_sent() -> None:
    stream = DeltaStream()
    got: list[str] = []

    async def read(n: int) -> None:
        for _ in range(n):
            got.append(await stream.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(read, 3)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        stream.send_nowait("a")
        await anyio.wait_all_tasks_blocked()
        assert got == ["a"]
        stream.send_nowait("b")
        stream.send_nowait("c")
    assert got == ["a", "b", "c"]


async def test_a_cancelled_wait_leaves_the_stream_usable() -> None:
    stream = DeltaStream()
    with anyio.move_on_after(0.01) as scope:
        await stream.receive()
    assert scope.cancelled_caught
    stream.send_nowait("late")
    stream.send_nowait("later")
    assert [await stream.receive(), await stream.receive()] == ["late", "later"]
