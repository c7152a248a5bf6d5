"""aioloader.mix over built loaders (`MixedLoaders`): items mixed whole in proportion, its stop modes,
exact resume (under weights changed at a load too), `async for`."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest
from support.mixes import Squares

from aioloader import Loader, MixedLoaders, StateError, mix, schedule


def two_loaders(stop: str = "all_exhausted") -> MixedLoaders:
    a = Loader(Squares("a", 24), batch_size=3, collate=None, shuffle=True, seed=1)
    b = Loader(Squares("b", 60), batch_size=3, collate=None, shuffle=True, seed=2)
    return mix([a, b], [1, 3], seed=6, stop=stop)


def test_loaders_mix_in_proportion_and_resume_exactly() -> None:
    with two_loaders("cycle") as both:
        whole = [batch for _, batch in zip(range(400), both, strict=False)]
    shares = Counter(b[0][0] for b in whole)
    assert abs(shares["b"] / 400 - 0.75) < 0.09  # 4 sd at n = 400
    with two_loaders("cycle") as both:
        head = [batch for _, batch in zip(range(150), both, strict=False)]
        state = both.state_dict()
    with two_loaders("cycle") as both:
        both.load_state_dict(state)
        middle = [batch for _, batch in zip(range(100), both, strict=False)]
        state = both.state_dict()
    with two_loaders("cycle") as both:
        both.load_state_dict(state)
        tail = [batch for _, batch in zip(range(150), both, strict=False)]
    assert head + middle + tail == whole


def test_loaders_mixed_stop_when_the_first_runs_out() -> None:
    with two_loaders("first_exhausted") as both:
        got = list(both)
    draws = mix([[0], [1]], [1, 3], seed=6).draws(0, 200)
    left = {0: 8, 1: 20}  # batches per epoch of each loader
    end = 0
    while left[draws[end]]:  # the first draw that finds its loader empty ends the epoch
        left[draws[end]] -= 1
        end += 1
    assert [0 if b[0][0] == "a" else 1 for b in got] == draws[:end]


def test_a_state_of_other_loaders_is_refused() -> None:
    with two_loaders() as both:
        state = both.state_dict()
    a, b = (Loader(Squares(n, 4), batch_size=2) for n in "ab")
    with mix([a, b], [1, 3], seed=6, stop="cycle") as other:
        with pytest.raises(StateError) as info:
            other.load_state_dict(state)
        assert info.value.field == "stop"


def _weighted(weights: Any) -> MixedLoaders:
    a = Loader(Squares("a", 24), batch_size=3, collate=None, shuffle=True, seed=1)
    b = Loader(Squares("b", 60), batch_size=3, collate=None, shuffle=True, seed=2)
    return mix([a, b], weights, seed=6, stop="cycle")


def test_a_state_loaded_under_other_weights_draws_with_them_from_its_position_on() -> None:
    """As a run whose schedule changed at the saved position: the same items, and later states
    say where the weights changed and what they were."""
    before, after = schedule([(0, [1.0, 3.0])]), schedule([(0, [3.0, 1.0])])
    with _weighted(before) as both:
        head = [batch for _, batch in zip(range(37), both, strict=False)]
        state = json.loads(json.dumps(both.state_dict()))
    with _weighted(after) as both:
        both.load_state_dict(state)
        rest = [batch for _, batch in zip(range(60), both, strict=False)]
        again = both.state_dict()
    spliced = schedule([(0, [1.0, 3.0]), (37, [3.0, 1.0])])
    with _weighted(spliced) as both:
        whole = [batch for _, batch in zip(range(97), both, strict=False)]
    assert head + rest == whole
    assert again["weights_changed"] == [
        {"epoch": 0, "position": 37, "was": state["config"]["weights"]}
    ]
    assert again["config"]["weights"] != state["config"]["weights"]
    with _weighted(after) as both:  # (a later state loads under the weights it was saved with)
        both.load_state_dict(again)
        assert both.state_dict()["weights_changed"] == again["weights_changed"]


@pytest.mark.asyncio
async def test_loaders_mixed_with_async_for_give_the_same_items() -> None:
    with two_loaders("all_exhausted") as both:
        expected = list(both)
    with two_loaders("all_exhausted") as both:
        got = [batch async for batch in both]
        assert got == expected
        both.set_epoch(0)
        head = []
        async for batch in both:
            head.append(batch)
            if len(head) == 5:
                break
        state = both.state_dict()
    with two_loaders("all_exhausted") as both:
        both.load_state_dict(state)
        assert head + list(both) == expected


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("saved", ["after the epoch", "at its last item"])
def test_a_state_saved_at_an_epochs_end_resumes_with_the_next_epoch(stop: str, saved: str) -> None:
    # The run it was saved from goes on with epoch 1: so does the resumed one, whether the state
    # was taken once the epoch had ended (the loaders then at different points of epoch 0) or
    # beside its last item (the end not yet found).
    with two_loaders(stop) as both:
        first, second = list(both), list(both)
    with two_loaders(stop) as both:
        state = None
        for _ in both:
            if saved == "at its last item":
                state = both.state_dict()
        if saved == "after the epoch":
            state = both.state_dict()
    assert state is not None
    with two_loaders(stop) as both:
        both.load_state_dict(state)
        assert list(both) == second
        assert list(both) != second  # and epoch 2 after it
    with two_loaders(stop) as both:
        both.load_state_dict(state)

        async def drain() -> list[object]:
            return [batch async for batch in both]

        assert asyncio.run(drain()) == second
    assert first != second
