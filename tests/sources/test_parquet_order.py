"""Parquet rows shared among ranks and resumed (`formats/parquet_order.py`): every row once in equal
shares, the rest after what was consumed, mid-epoch resume exact, elastic resume on another world
size, only the row groups still due read."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.parquetfiles import FILES, write_files

from aioloader import Loader
from aioloader._util.ranges import Ranges
from aioloader.sources import Parquet, parquet
from aioloader.sources.formats.parquet_order import epoch_rows, remaining, share


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_files(tmp_path_factory.mktemp("parquet"))


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    world=st.integers(1, 5),
    buffer=st.integers(0, 30),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_shares_hold_every_row_once_with_equal_lengths(
    counts: list[int], world: int, buffer: int, epoch: int, drop_last: bool
) -> None:
    n = sum(counts)
    order = epoch_rows(counts, True, buffer, 9, epoch)
    assert sorted(order.tolist()) == list(range(n))
    if buffer:
        plain_order = epoch_rows(counts, True, 0, 9, epoch)
        where = {row: i for i, row in enumerate(plain_order.tolist())}
        assert all(abs(where[row] - i) < buffer for i, row in enumerate(order.tolist()))
    shares = [share(remaining(Ranges(), n), r, world, drop_last) for r in range(world)]
    assert len({len(s) for s in shares}) == 1  # equal step counts
    taken = collections.Counter(i for s in shares for i in s.tolist())
    if drop_last:
        assert sum(taken.values()) == (n // world) * world
        assert max(taken.values(), default=1) == 1
    else:
        assert set(taken) == set(range(n))  # every row, and only padding twice
        assert sum(taken.values()) - n == len(shares[0]) * world - n < world


@settings(max_examples=25, deadline=None)
@given(consumed=st.sets(st.integers(0, 99), max_size=60), world=st.integers(1, 4))
def test_shares_after_consumed_hold_the_rest_once(consumed: set[int], world: int) -> None:
    left = remaining(Ranges.of(consumed), 100)
    taken = collections.Counter(i for r in range(world) for i in share(left, r, world, False))
    assert set(taken) == set(range(100)) - consumed


def ids_per_rank(files: list[str], world: int, **kw: Any) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        with Loader(parquet(files, ["id"], **kw), batch_size=16, rank=rank, world_size=world) as ld:
            out.append([b["id"].tolist() for b in ld])
    return out


def test_ranks_split_rows_without_overlap_and_with_equal_steps(files: list[str]) -> None:
    per_rank = ids_per_rank(files, 3, shuffle_buffer=40, seed=2)
    assert len({len(batches) for batches in per_rank}) == 1
    ids = [i for batches in per_rank for b in batches for i in b]
    n = sum(f[1] for f in FILES)
    assert set(ids) == set(range(n))
    assert len(ids) - n == -(-n // 3) * 3 - n


@pytest.mark.parametrize("rows_per_sample", [None, 30])
def test_mid_epoch_resume_gives_the_same_rest(
    files: list[str], rows_per_sample: int | None
) -> None:
    def make() -> Loader[Any]:
        source = parquet(files, ["id", "tokens"], shuffle_buffer=60, seed=4,
                         rows_per_sample=rows_per_sample)  # fmt: skip
        batch = 8 if rows_per_sample is None else None
        return Loader(source, batch_size=batch, collate=None, rank=1, world_size=2)

    def ids(batch: Any) -> list[int]:
        if rows_per_sample is None:
            return [s["id"] for s in batch]
        return list(batch.column("id").to_pylist())

    with make() as ld:
        list(ld)  # epoch 0
        it = iter(ld)
        head = [ids(next(it)) for _ in range(5)]
        state = ld.state_dict()
        rest = [ids(b) for b in it]
    with make() as ld:
        ld.load_state_dict(state)
        resumed = [ids(b) for b in ld]
        after = [ids(b) for b in ld]  # and the next epoch goes on as usual
    assert resumed == rest
    assert len(head) == 5
    assert state["epoch"] == 1
    with make() as ld:
        ld.set_epoch(2)
        assert [ids(b) for b in ld] == after


def test_elastic_resume_delivers_the_rest_once(files: list[str]) -> None:
    kw = {"shuffle_buffer": 30, "seed": 8}
    states, seen = [], []
    for rank in range(2):
        with Loader(parquet(files, ["id"], **kw), batch_size=10, rank=rank, world_size=2) as ld:
            it = iter(ld)
            seen += [i for _ in range(4 + rank) for i in next(it)["id"].tolist()]
            states.append(ld.state_dict())
    rest = []
    for rank in range(3):
        with Loader(parquet(files, ["id"], **kw), batch_size=10, rank=rank, world_size=3) as ld:
            ld.load_state_dict(states)
            rest += [i for b in ld for i in b["id"].tolist()]
    n = sum(f[1] for f in FILES)
    assert set(seen) | set(rest) == set(range(n))
    assert not set(seen) & set(rest)
    assert len(rest) - len(set(rest)) < 3  # wrap-around padding only


@pytest.mark.in_process
def test_resume_reads_only_the_row_groups_still_due(files: list[str]) -> None:
    def make() -> tuple[Parquet, Loader[Any]]:
        source = parquet(files[:1], ["id"], shuffle=False)  # 500 rows in row groups of 64
        return source, Loader(source, batch_size=8, collate=None)

    source, ld = make()
    with ld:
        it = iter(ld)
        head = [s["id"] for _ in range(16) for s in next(it)]  # two whole row groups
        state = ld.state_dict()
    source, ld = make()
    with ld:
        ld.load_state_dict(state)
        rest = [s["id"] for b in ld for s in b]
    assert head + rest == list(range(500))
    assert source.stats()["row_groups_read"] == 8 - 2
