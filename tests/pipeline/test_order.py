"""Order stage: permutations, rank shards with equal steps, and their properties."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aioloader
from aioloader._pipeline.order import KeyOrder, KeyPlan
from aioloader._util.ranges import Ranges
from aioloader._util.ranks import resolve_rank


def plan(
    n: int, batch: int | None, rank: int, world: int, drop_last: bool, shuffle: bool
) -> KeyPlan:
    order = KeyOrder(
        list(range(n)), shuffle=shuffle, seed=11, rank=rank, world_size=world, drop_last=drop_last
    )
    return KeyPlan(order, batch, drop_last)


def epoch_keys(p: KeyPlan, epoch: int) -> list[list[int]]:
    return [[k for _, k in g.items] for g in p.groups(epoch, Ranges())]  # type: ignore[union-attr]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 60),
    batch=st.one_of(st.none(), st.integers(1, 9)),
    world=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_every_key_once_per_epoch_and_equal_steps(
    n: int, batch: int | None, world: int, drop_last: bool, shuffle: bool, epoch: int
) -> None:
    per_rank = [
        epoch_keys(plan(n, batch, r, world, drop_last, shuffle), epoch) for r in range(world)
    ]
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks take different step counts: {steps}"
    assert all(len(b) == len(plan(n, batch, 0, world, drop_last, shuffle)) for b in per_rank)
    seen = collections.Counter(k for batches in per_rank for b in batches for k in b)
    if drop_last:
        # at most one of each; only the tail that does not fill every rank's batch is dropped
        assert all(c == 1 for c in seen.values())
        assert n - len(seen) < world * (batch or 1)
    else:
        assert set(seen) == set(range(n))  # complete
        padding = sum(seen.values()) - n  # wrap-around copies so that every rank has as many
        assert padding < world
        assert all(c <= 2 for c in seen.values()) or n < world


def test_without_shuffle_the_order_is_the_key_order() -> None:
    assert epoch_keys(plan(7, 3, 0, 1, False, False), 0) == [[0, 1, 2], [3, 4, 5], [6]]
    assert epoch_keys(plan(7, 2, 1, 2, False, False), 5) == [[1, 3], [5, 0]]


def test_set_epoch_changes_the_shuffle_and_seed_fixes_it() -> None:
    with aioloader.Loader(
        list(range(32)), lambda k: k, batch_size=8, collate=None, shuffle=True
    ) as a:
        first = list(a)
        second = list(a)  # the next iteration is the next epoch
        a.set_epoch(0)
        again = list(a)
    assert first == again
    assert first != second
    assert sorted(k for b in first for k in b) == list(range(32))


def test_loader_shards_across_ranks() -> None:
    def keys_of(rank: int) -> list[int]:
        with aioloader.Loader(
            list(range(10)), lambda k: k, batch_size=2, collate=None, rank=rank, world_size=3
        ) as loader:
            assert len(loader) == 2
            return [k for b in loader for k in b]

    shards = [keys_of(r) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]
    assert set().union(*shards) == set(range(10))


def test_rank_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(None, None) == (1, 4)
    assert resolve_rank(0, 2) == (0, 2)  # explicit arguments win


@pytest.mark.parametrize(
    ("rank", "world", "message"),
    [(2, 2, "rank must be in"), (0, 0, "world_size must be >= 1"), (1, None, "together")],
)
def test_bad_rank_arguments_name_the_argument(rank: int, world: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        aioloader.Loader([1, 2], lambda k: k, rank=rank, world_size=world)


def test_unsized_keys_cannot_be_sharded_or_shuffled() -> None:
    with pytest.raises(ValueError, match="world_size=2"):
        aioloader.Loader(iter([1, 2]), lambda k: k, rank=0, world_size=2)
    with pytest.raises(ValueError, match="shuffle"):
        aioloader.Loader(iter([1, 2]), lambda k: k, shuffle=True)


def test_async_iterable_keys_stream_into_batches() -> None:
    started = []

    async def listing():  # a streamed listing: the first batch needs only its own keys
        for i in range(10):
            started.append(i)
            yield f"k{i}"

    async def fetch(key: str) -> str:
        return key.upper()

    with aioloader.Loader(listing(), fetch, batch_size=4, collate=None) as loader:
        assert list(loader) == [["K0", "K1", "K2", "K3"], ["K4", "K5", "K6", "K7"], ["K8", "K9"]]


def test_ranges_round_trip() -> None:
    r = Ranges.of([5, 1, 2, 3, 9])
    assert r.pairs == [[1, 4], [5, 6], [9, 10]]
    assert Ranges(r.pairs) == r
    assert r.complement(11) == [0, 4, 6, 7, 8, 10]
    assert list(r.union([4, 0])) == [0, 1, 2, 3, 4, 5, 9]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60))
def test_ranges_add_is_the_set_of_the_ints_added(values: list[int]) -> None:
    """`add` (what a loader's delivered groups go through, one at a time) keeps the ranges
    sorted, disjoint and merged, in any order of adds; a negative int is refused."""
    r = Ranges()
    for v in values:
        r.add(v)
    assert r.pairs == Ranges.of(values).pairs
    with pytest.raises(ValueError, match="invalid range"):
        r.add(-1)


def test_map_style_dataset_is_sharded_without_a_fetch() -> None:
    class Squares(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> int:
            return i * i

    shards = []
    for rank in range(2):
        with aioloader.Loader(Squares(), batch_size=3, collate=None, rank=rank, world_size=2) as l2:
            shards.append([x for b in l2 for x in b])
    assert [len(s) for s in shards] == [5, 5]  # 9 padded to 10
    assert set(shards[0]) | set(shards[1]) == {i * i for i in range(9)}
