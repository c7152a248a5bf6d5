"""Each thread's own small cache (`_util/per_thread.py`): its bound, what goes first, and threads apart."""

from __future__ import annotations

import threading

import pytest

from aioloader._util.per_thread import PerThread


def test_a_new_key_in_a_full_cache_lets_the_oldest_put_go() -> None:
    kept: PerThread[str, int] = PerThread(limit=2)
    kept.put("a", 1)
    kept.put("b", 2)
    kept.put("a", 3)  # replaced in its place: still the oldest, and nothing goes
    assert (kept.get("a"), kept.get("b")) == (3, 2)
    kept.put("c", 4)
    assert (kept.get("a"), kept.get("b"), kept.get("c")) == (None, 2, 4)


def test_make_lets_the_oldest_go_before_it_makes_the_new_one() -> None:
    kept: PerThread[str, list[str]] = PerThread(limit=1)
    kept.put("a", ["a"])

    def make() -> list[str]:
        assert kept.get("a") is None  # gone already
        return ["b"]

    assert kept.make("b", make) == ["b"]
    assert kept.get("b") == ["b"]


def test_a_make_that_raises_keeps_nothing() -> None:
    kept: PerThread[str, int] = PerThread()

    def fail() -> int:
        raise OSError("no such file")

    with pytest.raises(OSError, match="no such file"):
        kept.make("a", fail)
    assert kept.get("a") is None


def test_no_bound_keeps_every_entry() -> None:
    kept: PerThread[int, int] = PerThread()
    for i in range(100):
        kept.put(i, i)
    assert all(kept.get(i) == i for i in range(100))


def test_each_thread_sees_only_its_own_entries() -> None:
    kept: PerThread[str, str] = PerThread(limit=1)
    kept.put("a", "main")
    seen: list[str | None] = []

    def other() -> None:
        seen.append(kept.get("a"))
        kept.put("b", "other")  # fills the other thread's cache, not this one's

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [None]
    assert (kept.get("a"), kept.get("b")) == ("main", None)
