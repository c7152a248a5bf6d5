"""Reordering: in order, a made group waits for those launched before it; as completed, none waits."""

from __future__ import annotations

import asyncio

from aioloader._pipeline.reorder import AsCompleted, InOrder, Item, reorder


def drain(out: asyncio.Queue[Item]) -> list[int]:
    return [out.get_nowait().group for _ in range(out.qsize())]


def item(index: int, error: BaseException | None = None) -> Item:
    return Item(index, f"batch {index}", 1, 0, error)


def launched(order: InOrder | AsCompleted, n: int) -> None:
    for index in range(n):
        order.launch(index)


def test_in_order_holds_a_group_until_those_before_it_are_made() -> None:
    out: asyncio.Queue[Item] = asyncio.Queue()
    moves: list[int] = []
    order = InOrder(out, lambda: moves.append(1), ends=True)
    launched(order, 3)
    assert not order.deliver(item(2))
    assert not order.deliver(item(1))
    assert drain(out) == []
    assert order.oldest() == 0
    assert not order.deliver(item(0))
    assert drain(out) == [0, 1, 2]
    assert len(moves) == 3


def test_as_completed_hands_each_group_over_at_once() -> None:
    out: asyncio.Queue[Item] = asyncio.Queue()
    order = reorder(False, out, lambda: None, ends=True)
    assert isinstance(order, AsCompleted)
    launched(order, 3)
    order.deliver(item(2))
    assert drain(out) == [2]
    assert order.oldest() == 0


def test_an_error_ends_the_epoch_when_its_turn_comes() -> None:
    out: asyncio.Queue[Item] = asyncio.Queue()
    order = InOrder(out, lambda: None, ends=True)
    launched(order, 2)
    assert not order.deliver(item(1, ValueError("bad")))
    assert order.failed == 1
    assert order.deliver(item(0))
    assert drain(out) == [0, 1]


def test_with_batch_errors_an_error_ends_its_batch_only() -> None:
    out: asyncio.Queue[Item] = asyncio.Queue()
    order = AsCompleted(out, lambda: None, ends=False)
    launched(order, 1)
    assert not order.deliver(item(0, ValueError("bad")))
    assert order.failed is None
