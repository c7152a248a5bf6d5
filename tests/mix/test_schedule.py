"""Mixture weights that follow a schedule (`aioloader.schedule`): the proportions measured over
windows follow it, step by step or interpolated; a loader over such a mix resumes exactly, on its
world size and on another; a saved state records the schedule and a Loader over a mix of sources
refuses a load under another (loaders mixed take it: tests/mix/test_mixed_loaders.py);
bad schedules are named. (A mix by rows, packed, resuming under a schedule: tests/pack.)"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from aioloader import Loader, StateError, mix, schedule

A = list(range(100_000))  # source 0
B = list(range(1_000_000, 1_100_000))  # source 1
WINDOW = 2_000


def loader(weights: Any, **kwargs: Any) -> Loader[Any]:
    both = mix({"a": A, "b": B}, weights, seed=7, stop="cycle")
    return Loader(both, batch_size=100, collate=list, **kwargs)


def share_of_b(batches: list[list[int]]) -> np.ndarray:
    """Per window of `WINDOW` positions, the share drawn from "b"."""
    drawn = np.asarray([k >= 1_000_000 for batch in batches for k in batch], dtype=np.float64)
    return drawn.reshape(-1, WINDOW).mean(axis=1)


@pytest.mark.parametrize("interpolate", ["step", "linear"])
def test_the_proportions_over_windows_follow_the_schedule(interpolate: str) -> None:
    weights = schedule([(0, {"a": 0.9, "b": 0.1}), (8_000, {"a": 0.3, "b": 0.7}),
                        (14_000, {"a": 0.5, "b": 0.5})], interpolate=interpolate)  # fmt: skip
    with loader(weights) as ld:
        it = iter(ld)
        batches = [next(it) for _ in range(200)]  # 20,000 positions, 10 windows
        it.close()  # type: ignore[attr-defined]
    got = share_of_b(batches)
    for w, share in enumerate(got):
        positions = np.arange(w * WINDOW, (w + 1) * WINDOW)
        if interpolate == "step":
            p = np.where(positions < 8_000, 0.1, np.where(positions < 14_000, 0.7, 0.5))
        else:
            p = np.interp(positions, [0, 8_000, 14_000], [0.1, 0.7, 0.5])
        want = float(p.mean())
        sigma = math.sqrt(float((p * (1 - p)).sum())) / WINDOW
        assert abs(share - want) < 5 * sigma, (w, share, want)  # within five standard deviations


def test_fixed_weights_draw_as_before_a_schedule_of_one_point() -> None:
    with loader([0.25, 0.75]) as fixed, loader(schedule([(0, [0.25, 0.75])])) as one:
        a, b = iter(fixed), iter(one)
        assert [next(a) for _ in range(30)] == [next(b) for _ in range(30)]
        a.close()  # type: ignore[attr-defined]
        b.close()  # type: ignore[attr-defined]


WEIGHTS = schedule([(0, [0.9, 0.1]), (1_500, [0.1, 0.9])], interpolate="linear")


def test_a_resume_goes_on_with_the_weights_in_force_there() -> None:
    with loader(WEIGHTS) as ld:
        it = iter(ld)
        whole = [next(it) for _ in range(40)]
        it.close()  # type: ignore[attr-defined]
    with loader(WEIGHTS) as ld:
        it = iter(ld)
        head = [next(it) for _ in range(17)]
        state = json.loads(json.dumps(ld.state_dict()))
        it.close()  # type: ignore[attr-defined]
    assert "weights=schedule([(0, [0.9, 0.1]), (1500" in state["config"]["keys"]  # recorded
    with loader(WEIGHTS) as ld:
        ld.load_state_dict(state)
        it = iter(ld)
        rest = [next(it) for _ in range(23)]
        it.close()  # type: ignore[attr-defined]
    assert head + rest == whole
    changed = schedule([(0, [0.9, 0.1]), (3_000, [0.1, 0.9])], interpolate="linear")
    with loader(changed) as ld, pytest.raises(StateError):
        ld.load_state_dict(state)


def test_an_elastic_resume_under_a_schedule_gives_the_epoch_once() -> None:
    def ranked(rank: int, world: int) -> Loader[Any]:
        both = mix([list(range(300)), list(range(1000, 1200))], WEIGHTS, seed=3)
        return Loader(both, batch_size=4, collate=list, rank=rank, world_size=world)

    want: set[int] = set()
    for rank in range(4):
        with ranked(rank, 4) as ld:
            want |= {k for batch in ld for k in batch}
    got: list[int] = []
    states = []
    for rank in range(4):
        with ranked(rank, 4) as ld:
            it = iter(ld)
            got += [k for _ in range(5) for k in next(it)]
            states.append(ld.state_dict())
            it.close()  # type: ignore[attr-defined]
    for rank in range(3):
        with ranked(rank, 3) as ld:
            ld.load_state_dict(states)
            got += [k for batch in ld for k in batch]
    assert set(got) == want
    assert len(got) - len(set(got)) <= (4 - 1 + 3 - 1) * 2  # the shares' padding


def test_bad_schedules_are_named() -> None:
    with pytest.raises(ValueError, match=r"interpolate: expected 'step' or 'linear'"):
        schedule([(0, [1, 1])], interpolate="cubic")
    with pytest.raises(ValueError, match=r"points\[0\]: positions start at 0"):
        schedule([(5, [1, 1])])
    with pytest.raises(ValueError, match=r"points\[1\]: positions start at 0 and increase"):
        schedule([(0, [1, 1]), (0, [1, 2])])
    with pytest.raises(TypeError, match=r"points\[1\]: expected a \(position, weights\) pair"):
        schedule([(0, [1, 1]), 7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"points\[1\]: weights: all are zero"):
        mix([A, B], schedule([(0, [1, 1]), (10, [0, 0])]))
    with pytest.raises(ValueError, match=r"points\[0\]: weights: 3 weights for 2 sources"):
        mix([A, B], schedule([(0, [1, 1, 1])]))


@pytest.mark.parametrize("interpolate", ["step", "linear"])
def test_blocks_whose_weights_hold_draw_what_position_by_position_draws(interpolate: str) -> None:
    """A block over which the weights hold is drawn from one row's bounds (the fast path): the
    same picks as each position's own weights give, so states saved either way resume alike."""
    from aioloader._mix.choices import _CHOICE_SALT, BLOCK, Choices

    sched = schedule([(0, [0.2, 0.3, 0.5]), (BLOCK, [0.2, 0.3, 0.5]),
                      (2 * BLOCK + 17, [0.6, 0.0, 0.4]), (5 * BLOCK, [0.0, 1.0, 0.0])],
                     interpolate=interpolate)  # fmt: skip
    choices = Choices(sched, seed=3, epoch=1)
    held = [sched.constant(b * BLOCK, (b + 1) * BLOCK) for b in range(7)]
    assert True in held
    assert False in held
    for block in range(7):
        rng = np.random.default_rng([3, 1, block, _CHOICE_SALT])
        by_rows = choices._drawn_by_rows(rng, block * BLOCK)
        assert np.array_equal(choices._draw(block), by_rows), block
