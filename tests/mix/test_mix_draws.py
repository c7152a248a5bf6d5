"""aioloader.mix, its rule: the proportions drawn, the same sequence whatever the timing, and what
each `stop` mode does when a source runs out."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.mixes import SlowSource, SlowStream, Squares, Stream, batches, stream_keys

from aioloader import Loader, mix

WEIGHTS = [0.6, 0.3, 0.1]


def test_realised_proportions_match_the_weights_over_10000_draws() -> None:
    # Fixed seed: the counts are fixed; the bound is 4 standard deviations of a fair draw at
    # n = 10,000 (0.6: sd 0.0049), which uniform (0.33 each) or round-robin picks miss by 0.23.
    m = mix([Squares("a", 50), Squares("b", 50), Squares("c", 50)], WEIGHTS, seed=0, stop="cycle")
    with Loader(m, batch_size=100, collate=None, concurrency=32) as loader:
        got = [s[0] for batch in batches(loader, 100) for s in batch]
    assert len(got) == 10_000
    counts = Counter(got)
    for name, w in zip("abc", WEIGHTS, strict=True):
        assert abs(counts[name] / 10_000 - w) < 0.02, counts
    assert [c for c in m.draws(0, 10_000)] == ["abc".index(s) for s in got]


def test_every_batch_mixes_the_sources() -> None:
    m = mix([Squares("a", 500), Squares("b", 500)], [1, 1], seed=3, stop="cycle")
    with Loader(m, batch_size=64, collate=None) as loader:
        for batch in batches(loader, 20):
            share = sum(s[0] == "a" for s in batch) / 64
            assert 0.25 < share < 0.75


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    weights=st.lists(st.integers(0, 4), min_size=1, max_size=5).filter(any),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 50),
)
def test_zero_weight_never_draws_and_draws_are_pure(
    weights: list[int], seed: int, epoch: int
) -> None:
    m = mix([[i] for i in range(len(weights))], weights, seed=seed, stop="cycle")
    first = m.draws(epoch, 5000)
    assert first == m.draws(epoch, 5000)  # a pure function of (seed, epoch, position)
    assert {i for i in first if weights[i] == 0} == set()
    counts = Counter(first)
    total = sum(weights)
    for i, w in enumerate(weights):  # a loose bound (8 sd at n = 5000) that no wrong rule meets
        assert abs(counts[i] / 5000 - w / total) < 0.06


# -- determinism whatever the timing -----------------------------------------------------------------


def test_sequence_does_not_depend_on_timing() -> None:
    def run(slow: bool, concurrency: int, in_order: bool) -> list[Any]:
        a = SlowSource("a", 30) if slow else [("a", i) for i in range(30)]
        b = SlowStream("b", 20) if slow else Stream("b", 20)
        m = mix([a, b, Squares("c", 10)], [2, 1, 1], seed=11, stop="all_exhausted")
        with Loader(m, batch_size=4, collate=None, concurrency=concurrency,
                    in_order=in_order) as loader:  # fmt: skip
            return [*batches(loader), *batches(loader)]  # two epochs

    calm = run(False, 1, True)
    assert run(True, 16, True) == calm
    assert sorted(map(str, run(True, 16, False))) == sorted(map(str, calm))  # same batches


# -- stop modes ---------------------------------------------------------------------------------------


def test_first_exhausted_ends_at_the_first_source_that_runs_out() -> None:
    m = mix([Squares("a", 5), Squares("b", 1000)], [1, 1], seed=2, stop="first_exhausted")
    keys = stream_keys(m, 0)
    draws = m.draws(0, 2000)
    sixth_a = [p for p, i in enumerate(draws) if i == 0][5]
    assert len(keys) == sixth_a  # ended by the draw that found "a" empty
    assert sorted(k.key for k in keys if k.source == 0) == list(range(5))
    assert [k.source for k in keys] == draws[: len(keys)]


def test_all_exhausted_restarts_what_runs_out_until_every_source_has() -> None:
    m = mix([Squares("a", 4), Squares("b", 30), Squares("z", 9)], [1, 1, 0], stop="all_exhausted")
    keys = stream_keys(m, 3)
    b = [k for k in keys if k.source == 1]
    assert sorted(k.key for k in b) == list(range(30))
    assert {k.epoch for k in b} == {3}
    a = [k for k in keys if k.source == 0]
    epochs = sorted({k.epoch for k in a})
    assert epochs[0] == 3
    assert len(epochs) > 2
    for e in epochs[:-1]:  # each of its whole epochs is one reshuffle of all its keys
        assert sorted(k.key for k in a if k.epoch == e) == list(range(4))
    assert [k.key for k in a if k.epoch == 3] != [k.key for k in a if k.epoch == 4]
    assert all(k.source != 2 for k in keys)  # a weight of 0 is never drawn nor waited for


def test_cycle_never_ends_and_each_source_keeps_its_own_epochs() -> None:
    m = mix([Squares("a", 3), Squares("b", 7)], [1, 2], seed=4, stop="cycle")
    keys = stream_keys(m, 0, 600)
    assert len(keys) == 600
    for source, n in ((0, 3), (1, 7)):
        mine = [k for k in keys if k.source == source]
        assert [k.index for k in mine] == [i % n for i in range(len(mine))]
        assert [k.epoch for k in mine] == [i // n for i in range(len(mine))]


def test_a_one_shot_iterator_cannot_start_again() -> None:
    m = mix([iter([1, 2]), Squares("b", 50)], [1, 1], stop="cycle")
    with pytest.raises(ValueError, match=r"sources\[0\] gave no samples in its epoch 1"):
        stream_keys(m, 0, 100)
