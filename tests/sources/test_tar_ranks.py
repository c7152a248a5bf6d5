"""Tar shards across ranks: equal steps over uneven shards, states that name the rank, exact elastic
resume onto fewer and more ranks (the ranks simulated in one process by rank / world_size)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.shardfiles import SIZES, write_shards
from torch.distributed import HashStore

from aioloader import FetchError, Loader, StateError
from aioloader._util.ranges import Ranges
from aioloader.sources.formats.tar import sample_key
from aioloader.sources.formats.tar_counts import count_local, count_together
from aioloader.sources.formats.tar_share import shard_order
from aioloader.sources.tar import count_samples, tar_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("uneven"), SIZES)


ALL = {f"{s}-{i}" for s, n in enumerate(SIZES) for i in range(n)}


def names(batch: list[dict[str, Any]]) -> list[str]:
    return [sample["txt"].decode() for sample in batch]


def make(shards: list[str], rank: int, world: int, **kw: Any) -> Loader[Any]:
    source = tar_shards(shards, shuffle_buffer=kw.pop("shuffle_buffer", 6), seed=3, parallel=2,
                        sample_counts=kw.pop("sample_counts", None))  # fmt: skip
    return Loader(source, batch_size=4, collate=names, rank=rank, world_size=world, **kw)


def collect(stream: AsyncIterator[dict[str, Any]]) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [sample async for sample in stream]

    return asyncio.run(run())


def head_and_state(loader: Loader[Any], batches: int) -> tuple[list[str], dict[str, Any]]:
    it = iter(loader)
    got = [name for _ in range(batches) for name in next(it)]
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()  # type: ignore[attr-defined]
    return got, state


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_the_same_number_of_batches_over_uneven_shards(
    shards: list[str], drop_last: bool
) -> None:
    per_rank = []
    for rank in range(4):
        with make(shards, rank, 4, drop_last=drop_last) as loader:
            per_rank.append([list(batch) for batch in loader])
    assert len({len(batches) for batches in per_rank}) == 1  # equal steps
    every = [name for batches in per_rank for batch in batches for name in batch]
    if drop_last:  # 88 = 4 x 22: cut to full batches of 4, 20 samples a rank
        assert len(every) == 4 * 20
        assert len(set(every)) == len(every)
    else:  # 88 = 4 x 22: nothing padded
        assert set(every) == ALL
        assert len(every) == len(ALL)


def test_padding_wraps_around_and_counts_given_equal_counts_found(shards: list[str]) -> None:
    counted = count_samples(shards)
    assert counted == SIZES
    runs = []
    for counts in (None, SIZES, dict(zip(shards, SIZES, strict=True))):
        got = []
        for rank in range(3):  # 88 among 3: 30 each, two of them padding
            with make(shards, rank, 3, sample_counts=counts) as loader:
                got.append([name for batch in loader for name in batch])
        runs.append(got)
    assert runs[0] == runs[1] == runs[2]
    assert [len(r) for r in runs[0]] == [30, 30, 30]
    every = [name for r in runs[0] for name in r]
    assert set(every) == ALL
    assert len(every) - len(ALL) == 2


def test_a_state_records_the_real_rank_and_world_size(shards: list[str]) -> None:
    with make(shards, 2, 4) as loader:
        _, state = head_and_state(loader, 1)
    assert (state["rank"], state["world_size"]) == (2, 4)


@pytest.mark.parametrize("shuffle_buffer", [0, 6])
@pytest.mark.parametrize("new_world", [3, 5, 1])
def test_elastic_resume_delivers_each_remaining_sample_once(
    shards: list[str], new_world: int, shuffle_buffer: int
) -> None:
    delivered: list[str] = []
    states = []
    for rank in range(4):
        with make(shards, rank, 4, shuffle_buffer=shuffle_buffer) as loader:
            got, state = head_and_state(loader, 3)
        delivered += got
        states.append(state)
    rest = []
    for rank in range(new_world):
        with make(shards, rank, new_world, shuffle_buffer=shuffle_buffer) as loader:
            loader.load_state_dict(states)
            rest.append([name for batch in loader for name in batch])
    assert len({len(r) for r in rest}) == 1, "every new rank takes the same number of samples"
    after = [name for r in rest for name in r]
    left = ALL - set(delivered)
    assert len(delivered) == len(set(delivered)) == 48
    assert set(after) == left  # none lost
    assert not set(after) & set(delivered)  # none delivered again
    assert len(after) - len(left) < new_world  # only wrap-around padding repeats


def test_elastic_resume_twice_stays_exact(shards: list[str]) -> None:
    delivered: list[str] = []
    states = []
    for rank in range(4):
        with make(shards, rank, 4) as loader:
            got, state = head_and_state(loader, 2)
        delivered, states = delivered + got, [*states, state]
    again = []
    for rank in range(3):
        with make(shards, rank, 3) as loader:
            loader.load_state_dict(states)
            got, state = head_and_state(loader, 2)
        delivered, again = delivered + got, [*again, state]
    rest = []
    for rank in range(2):
        with make(shards, rank, 2) as loader:
            loader.load_state_dict(again)
            rest += [name for batch in loader for name in batch]
    assert Counter(delivered).most_common(1)[0][1] == 1
    assert set(rest) == ALL - set(delivered)
    assert len(rest) - len(ALL - set(delivered)) < 2


def test_same_world_resume_of_a_rank_continues_its_own_stream(shards: list[str]) -> None:
    with make(shards, 1, 4) as loader:
        whole = [name for batch in loader for name in batch]
    with make(shards, 1, 4) as loader:
        head, state = head_and_state(loader, 2)
    with make(shards, 1, 4) as loader:
        loader.load_state_dict(state)
        tail = [name for batch in loader for name in batch]
    assert head + tail == whole


def test_wrong_sample_counts_are_named(shards: list[str]) -> None:
    with pytest.raises(ValueError, match="sample_counts: 2 counts for 10 shards"):
        tar_shards(shards, sample_counts=[1, 2])
    with pytest.raises(ValueError, match=r"sample_counts\[1\]: expected an int >= 0"):
        tar_shards(shards, sample_counts=[1, -1, *SIZES[2:]])
    with pytest.raises(ValueError, match="no count for shard"):
        tar_shards(shards, sample_counts={shards[0]: 7})
    with pytest.raises(TypeError, match="sample_counts: expected one int per shard"):
        tar_shards(shards, sample_counts="7")
    short = [SIZES[0] + 1, *SIZES[1:]]  # shard 0 has one sample fewer than said

    def read_both_ranks() -> None:
        for rank in range(2):
            with make(shards, rank, 2, sample_counts=short, shuffle_buffer=0) as loader:
                list(loader)

    with pytest.raises(FetchError, match=r"part-000\.tar: 7 samples, but sample_counts says 8"):
        read_both_ranks()


def test_a_state_of_other_shards_or_order_is_refused(shards: list[str]) -> None:
    with make(shards[:5], 0, 2) as loader:
        _, state = head_and_state(loader, 1)
    for other in (shards, shards[:5]):
        with make(other, 0, 2, shuffle_buffer=0 if other is not shards else 6) as loader:
            with pytest.raises(StateError, match="config field 'keys'") as err:
                loader.load_state_dict(state)
            assert err.value.field == "keys"


@pytest.mark.asyncio
async def test_async_ranks_resume_elastically_inside_a_running_loop(shards: list[str]) -> None:
    """`async for` and a load made on a running loop (the counts and positions are then found
    on a loop of their own, in a thread); an early break leaves the shard reads closed."""
    delivered: list[str] = []
    states = []
    for rank in range(2):
        loader = make(shards, rank, 2, sample_counts=None)
        async with loader:
            async for batch in loader:
                delivered += batch
                if len(delivered) >= 8 * (rank + 1):
                    break  # early: the reader's segments close
            states.append(loader.state_dict())
    rest = []
    for rank in range(3):
        loader = make(shards, rank, 3)
        async with loader:
            loader.load_state_dict(states)
            rest += [name async for batch in loader for name in batch]
    assert set(rest) == ALL - set(delivered)
    assert not set(rest) & set(delivered)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


@pytest.mark.asyncio
async def test_ranks_count_together_each_shard_once_and_pass_a_failure_on(
    shards: list[str],
) -> None:
    """Three ranks share one key-value store (as a torch.distributed job's): every shard is
    counted once in all, each rank gets every count; a count that fails on one rank is an error
    naming the shard on the others."""
    store = HashStore()
    calls: Counter[str] = Counter()

    async def count(shard: str) -> int:
        calls[shard] += 1
        await asyncio.sleep(0)
        return await asyncio.to_thread(count_local, shard, sample_key)

    asked: Counter[str] = Counter()
    asking = threading.Lock()  # the requests come from threads: with the GIL off, `+=` loses some

    class Counting:  # the store's requests, by kind
        def __getattr__(self, name: str) -> Any:
            with asking:
                asked[name] += 1
            return getattr(store, name)

    ranks = [count_together(shards, count, Counting(), 2) for r in range(3)]
    results = await asyncio.gather(*ranks)
    assert [counts for counts, _ in results] == [SIZES] * 3
    assert sum(n for _, n in results) == len(shards)
    assert set(calls.values()) == {1}
    # tickets from one counter: a draw per shard and a last one per drawing task, not a claim
    # per shard and rank (3 x 10); then each rank waits once and reads every count at once
    assert asked["add"] == len(shards) + 3 * 2
    assert asked["set"] == len(shards)
    assert asked["wait"] == asked["multi_get"] == 3
    assert asked["get"] == 0

    broken = HashStore()

    async def failing(shard: str) -> int:
        if shard == shards[4]:
            raise FetchError(f"tar shard {shard}: truncated", key=shard)
        return await count(shard)

    outcomes = await asyncio.gather(
        count_together(shards, failing, broken, 2),
        count_together(shards, failing, broken, 2),
        return_exceptions=True,
    )
    assert all(isinstance(outcome, FetchError) for outcome in outcomes)
    texts = sorted(str(outcome) for outcome in outcomes)  # whichever rank drew shard 4's ticket
    assert "failed on the rank that counted it" in texts[0]
    assert "truncated" in texts[1]
    assert all(outcome.key == shards[4] for outcome in outcomes)  # type: ignore[union-attr]


def test_positions_replay_the_real_stream(tmp_path: Path) -> None:
    """What a state counts as delivered is `positions`, found without reading: over random shard
    sizes (empty shards too), readers, `parallel`, shuffle buffers, epochs, consumed positions and
    `drop_last`, it is the stream each reader really reads, sample for sample."""
    rng = random.Random(1)
    for trial in range(25):
        sizes = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 9))]
        total = sum(sizes)
        if not total:
            continue
        folder = tmp_path / str(trial)
        folder.mkdir()
        paths = write_shards(folder, sizes)
        parallel, buffer = rng.randrange(1, 5), rng.choice([0, 2, 5, 13])
        world, epoch, drop = rng.randrange(1, 6), rng.randrange(3), rng.random() < 0.3
        consumed = Ranges.of(rng.sample(range(total), rng.randrange(total)))
        order = shard_order(len(paths), True, 7, epoch)
        first = dict(zip(order, np.cumsum([0] + [sizes[s] for s in order]).tolist(), strict=False))
        for rank in range(world):
            src = tar_shards(paths, parallel=parallel, shuffle_buffer=buffer, seed=7, rank=rank,
                             world_size=world, sample_counts=sizes)  # fmt: skip
            stream = src.samples(epoch, consumed=consumed, drop_last=drop)
            real = [
                first[s] + i for s, i in (map(int, x["txt"].split(b"-")) for x in collect(stream))
            ]
            assert src.positions(epoch, consumed, drop, rank, world, None) == real, (trial, rank)
