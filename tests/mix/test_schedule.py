"""Mixture weights that follow a schedule (`aioloader.schedule`): the proportions measured over
windows follow it, step by step or interpolated; a loader over such a mix resumes exactly, on its
world size and on another; a saved state records the weights, and a load under others draws with
them from its position on (loaders mixed: tests/mix/test_mixed_loaders.py); bad schedules are
named. (A mix by rows, packed, resuming under a schedule: tests/pack.)"""

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
    recorded = {"schedule": [[0, [0.9, 0.1]], [1500, [0.1, 0.9]]], "interpolate": "linear"}
    assert state["weights"] == recorded
    assert "weights_changed" not in state
    with loader(WEIGHTS) as ld:
        ld.load_state_dict(state)
        it = iter(ld)
        rest = [next(it) for _ in range(23)]
        it.close()  # type: ignore[attr-defined]
    assert head + rest == whole


def batches(ld: Loader[Any], n: int, state: Any = None) -> tuple[list[Any], dict[str, Any]]:
    """`n` batches of `ld` (after loading `state`), and the state after them (through JSON)."""
    if state is not None:
        ld.load_state_dict(state)
    it = iter(ld)
    got = [next(it) for _ in range(n)]
    saved = json.loads(json.dumps(ld.state_dict()))
    it.close()  # type: ignore[attr-defined]
    ld.close()
    return got, saved


def test_a_state_loaded_under_other_weights_draws_with_them_from_its_position_on() -> None:
    """As a run whose weights changed at each saved position: the same batches; later states say
    where the weights changed and what they were; a state loads again under its own weights."""
    w0, w2 = [0.75, 0.25], [0.5, 0.5]
    w1 = schedule([(0, [0.25, 0.75]), (5_000, [0.5, 0.5])])
    spliced = schedule([(0, w0), (1_700, [0.25, 0.75]), (2_900, w2)])
    whole, _ = batches(loader(spliced), 40)
    head, s1 = batches(loader(w0), 17)
    middle, s2 = batches(loader(w1), 12, s1)
    rest, s3 = batches(loader(w2), 11, s2)
    assert head + middle + rest == whole
    assert s2["weights_changed"] == [{"epoch": 0, "position": 1_700, "was": w0}]
    assert s3["weights_changed"] == [*s2["weights_changed"], {"epoch": 0, "position": 2_900,
                                                               "was": s2["weights"]}]  # fmt: skip
    again, _ = batches(loader(w1), 11, s2)  # (under the weights it was saved with: no change)
    assert head + middle + again == batches(loader(schedule([(0, w0), (1_700, [0.25, 0.75])])),
                                            40)[0]  # fmt: skip
    broken = dict(s2, weights_changed=[{"epoch": 0, "position": 5, "was": [1.0]}])
    with loader(w1) as ld, pytest.raises(StateError, match="weights_changed: expected") as caught:
        ld.load_state_dict(broken)
    assert caught.value.field == "weights_changed"


def test_an_elastic_resume_draws_on_from_where_the_old_ranks_stood() -> None:
    """The new ranks' draws begin at the furthest old rank's (not at the epoch's start): the
    weights in force there draw, and a state says where the draws began."""
    turn = schedule([(0, [0.9, 0.1]), (400, [0.1, 0.9])])

    def ranked(rank: int, world: int) -> Loader[Any]:
        both = mix([list(range(10_000)), list(range(10_000, 20_000))], turn, seed=5)
        return Loader(both, batch_size=4, collate=list, rank=rank, world_size=world)

    old = [batches(ranked(rank, 4), 150)[1] for rank in range(4)]  # 600 draws each
    head, state = batches(ranked(1, 3), 50, old)
    assert state["draws_from"] == [0, 600]
    second = sum(k >= 10_000 for batch in head for k in batch) / 200
    assert second > 0.75  # (from the epoch's start again: 0.1)


def test_an_elastic_resume_takes_other_weights_from_where_the_old_ranks_stood() -> None:
    """Each sample of the uninterrupted epoch once (its end as the old weights had it), drawn
    with the new weights from the furthest old rank's draw on; later states say so."""
    before, after = [1.0, 1.0], [1.0, 3.0]

    def ranked(rank: int, world: int, weights: Any) -> Loader[Any]:
        both = mix([list(range(300)), list(range(1000, 1200))], weights, seed=3)
        return Loader(both, batch_size=4, collate=list, rank=rank, world_size=world)

    want: set[int] = set()
    for rank in range(4):
        with ranked(rank, 4, before) as ld:
            want |= {k for batch in ld for k in batch}
    got: list[int] = []
    old = []
    for rank in range(4):
        head, state = batches(ranked(rank, 4, before), 5)
        got += [k for batch in head for k in batch]
        old.append(state)
    for rank in range(3):
        with ranked(rank, 3, after) as ld:
            ld.load_state_dict(old)
            got += [k for batch in ld for k in batch]
            saved = ld.state_dict()
        assert saved["weights_changed"] == [{"epoch": 0, "position": 20, "was": before}]
        assert saved["draws_from"] == [0, 20]
    assert set(got) == want
    assert len(got) - len(set(got)) <= (4 - 1 + 3 - 1) * 2  # the shares' padding


def test_a_refused_load_leaves_the_draws_as_they_were() -> None:
    """A load on another world size refused after the old ranks' weights were taken (a rank's
    state missing): the loader draws its epoch afresh, under its own weights."""

    def ranked(rank: int, world: int, weights: Any) -> Loader[Any]:
        both = mix([list(range(300)), list(range(1000, 1200))], weights, seed=3)
        return Loader(both, batch_size=4, collate=list, rank=rank, world_size=world)

    old = [batches(ranked(rank, 4, [1.0, 1.0]), 5)[1] for rank in range(4)]
    fresh, _ = batches(ranked(0, 3, [1.0, 3.0]), 10)
    with ranked(0, 3, [1.0, 3.0]) as ld:
        with pytest.raises(StateError, match="need ranks"):
            ld.load_state_dict([old[0], old[1], old[3]])
        it = iter(ld)
        assert [next(it) for _ in range(10)] == fresh
        it.close()  # type: ignore[attr-defined]


def test_an_epoch_resumed_elsewhere_takes_other_weights_from_its_own_draw() -> None:
    """Reloaded on its world size under other weights, an epoch resumed on another world size
    changes them at the draw its stream had reached (past the draws of sources it had spent):
    each source gives the keys it would have, in its order, in another interleaving."""
    before = schedule([(0, [1, 1, 1]), (400, [0.1, 1, 1])])
    after = schedule([(0, [1, 1, 3]), (400, [0.1, 1, 3])])

    def ranked(rank: int, world: int, weights: Any) -> Loader[Any]:
        sources = [list(range(3_000)), list(range(10_000, 10_400)), list(range(20_000, 22_000))]
        return Loader(mix(sources, weights, seed=3), batch_size=4, collate=list, rank=rank,
                      world_size=world)  # fmt: skip

    old = [batches(ranked(rank, 4, before), 10)[1] for rank in range(4)]
    for rank in range(3):
        with ranked(rank, 3, before) as ld:
            ld.load_state_dict(old)
            unchanged = [k for batch in ld for k in batch]
        head, state = batches(ranked(rank, 3, before), 93, old)  # (a source spent by then)
        with ranked(rank, 3, after) as ld:
            ld.load_state_dict(state)
            got = [k for batch in head for k in batch] + [k for batch in ld for k in batch]
            changed = ld.state_dict()["weights_changed"]
        assert changed[0]["was"] == state["weights"]
        assert changed[0]["position"] > 40 + 93 * 4  # the old ranks' 40 draws, then its own
        assert got != unchanged
        for source in range(3):
            assert [k for k in got if k // 10_000 == source] == [
                k for k in unchanged if k // 10_000 == source
            ]


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
