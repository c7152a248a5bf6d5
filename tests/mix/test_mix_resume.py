"""aioloader.mix resumed from a loader's state: the exact sequence, at any point, with any executor,
without making the keys before the stop again; a state of another mix refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.mixes import SlowSource, SlowStream, Squares, Stream, batches, label, three

from aioloader import Loader, StateError, mix


def run_from(
    state: dict[str, Any] | None, stop: str, n: int | None, **kwargs: Any
) -> tuple[list[Any], dict[str, Any]]:
    with Loader(three(stop), batch_size=3, decode=label, **kwargs) as loader:
        if state is not None:
            loader.load_state_dict(state)
        got = batches(loader, n)
        return got, loader.state_dict()


@pytest.mark.parametrize("stop", ["all_exhausted", "cycle"])
def test_resume_continues_the_exact_sequence_twice(stop: str) -> None:
    whole, _ = run_from(None, stop, 30, executor="inline")
    first, state = run_from(None, stop, 7, executor="inline", concurrency=2)
    second, state = run_from(state, stop, 9, executor="inline", concurrency=32)
    third, _ = run_from(state, stop, 14, executor="thread", concurrency=5)
    assert first + second + third == whole


def test_resume_with_process_workers_and_another_concurrency() -> None:
    whole, _ = run_from(None, "all_exhausted", None, executor="thread", concurrency=4)
    first, state = run_from(None, "all_exhausted", 4, executor="thread", concurrency=4)
    rest, _ = run_from(state, "all_exhausted", None, executor="process", workers=2, concurrency=16)
    assert first + rest == whole


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    stop=st.sampled_from(["first_exhausted", "all_exhausted", "cycle"]),
    seed=st.integers(0, 1000),
    cut=st.integers(0, 20),
    batch_size=st.integers(1, 5),
)
def test_resume_at_any_point_is_exact(stop: str, seed: int, cut: int, batch_size: int) -> None:
    def loader() -> Loader[Any]:
        return Loader(three(stop, seed), batch_size=batch_size, collate=None, concurrency=8)

    with loader() as a:
        whole = batches(a, 25)
    with loader() as b:
        head = batches(b, min(cut, len(whole)))
        state = b.state_dict()
    with loader() as c:
        c.load_state_dict(state)
        tail = batches(c, len(whole) - len(head))
    assert head + tail == whole


def test_resume_out_of_order_loses_and_repeats_nothing() -> None:
    def loader() -> Loader[Any]:
        m = mix([SlowSource("a", 40), SlowStream("b", 30)], [1, 1], seed=8, stop="all_exhausted")
        return Loader(m, batch_size=3, collate=None, in_order=False, concurrency=16)

    with loader() as a:
        whole = batches(a)
    with loader() as b:
        head = batches(b, 6)
        state = b.state_dict()
    with loader() as c:
        c.load_state_dict(state)
        tail = batches(c)
    assert sorted(map(str, head + tail)) == sorted(map(str, whole))


class Counted(Sequence[int]):
    """Samples 0..n-1 that count how many were looked up."""

    def __init__(self, n: int) -> None:
        self.n, self.looked_up = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        self.looked_up += 1
        return i


def test_resume_moves_the_sources_without_making_the_keys_before() -> None:
    def run(state: dict[str, Any] | None, n: int) -> tuple[list[Any], dict[str, Any], Counted]:
        big = Counted(100_000)
        m = mix([big, Stream("s", 7)], [9, 1], seed=2, stop="cycle")
        with Loader(m, batch_size=10, collate=None, concurrency=4, prefetch=1) as loader:
            if state is not None:
                loader.load_state_dict(state)
            got = batches(loader, n)
            return got, loader.state_dict(), big

    whole, _, _ = run(None, 300)
    head, state, _ = run(None, 290)
    tail, _, big = run(state, 10)
    assert head + tail == whole
    # the 2,600 keys of "big" before the stop were counted past, not made again
    assert big.looked_up < 400


def test_a_state_from_other_weights_is_refused() -> None:
    with Loader(three(), batch_size=2) as loader:
        batches(loader, 1)
        state = loader.state_dict()
    other = mix([Squares("sq", 40), [("list", i) for i in range(25)], Stream("st", 15)], [1, 1, 1])
    with Loader(other, batch_size=2) as loader, pytest.raises(StateError) as info:
        loader.load_state_dict(state)
    assert info.value.field == "keys"
