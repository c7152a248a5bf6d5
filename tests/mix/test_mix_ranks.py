"""aioloader.mix across ranks: each source shared among them as the order stage deals keys, equal steps,
and exact resume onto fewer and more ranks, for a mix of two key lists and of tar shards with a key
list (ranks simulated in one process by rank / world_size)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.mixes import Squares, Stream, batches, stream_keys
from support.shardfiles import SIZES, write_shards

from aioloader import Loader, MixKey, StateError, mix, sources
from aioloader._pipeline.order import shard

A = [f"a{i}" for i in range(61)]
B = [f"b{i}" for i in range(37)]
TAR = [f"{s}-{i}" for s, n in enumerate(SIZES) for i in range(n)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("mixed"), SIZES)


def label(key: MixKey, sample: Any) -> tuple[int, int, str]:
    """(source, that source's epoch, the sample's name): what a delivery is counted by."""
    name = sample["txt"].decode() if isinstance(sample, dict) else sample
    return key.source, key.epoch, name


def make(kind: str, shards: list[str], stop: str, rank: int, world: int) -> Loader[Any]:
    if kind == "lists":
        inputs: list[Any] = [A, B]
    else:
        inputs = [sources.tar_shards(shards, shuffle_buffer=5, seed=2), B]
    both = mix(inputs, [2, 1], seed=4, stop=stop)
    return Loader(both, batch_size=4, collate=list, decode=label, decode_with_key=True,
                  rank=rank, world_size=world)  # fmt: skip


def test_ranks_share_each_source_and_take_equal_steps() -> None:
    seen: list[tuple[str, int]] = []
    steps = []
    for rank in (0, 1):
        m = mix([Squares("a", 9), Squares("b", 40)], [1, 1], seed=1, stop="all_exhausted")
        with Loader(m, batch_size=2, collate=None, rank=rank, world_size=2) as loader:
            got = batches(loader)
        steps.append(len(got))
        seen += [s for b in got for s in b if s[0] == "b"]
    assert steps[0] == steps[1]
    assert sorted(i for _, i in seen) == [i * i for i in range(40)]  # each "b" sample once


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_ranks_share_is_dealt_as_the_order_stage_deals_keys(shuffle: bool) -> None:
    for world in (2, 3, 7):
        for rank in range(world):
            m = mix([list(range(103))], [1], shuffle=shuffle, stop="first_exhausted")
            m.bind(rank=rank, world_size=world)
            unshared = mix([list(range(103))], [1], shuffle=shuffle, stop="first_exhausted")
            order = [k.key for k in stream_keys(unshared, 5)]
            assert [k.key for k in stream_keys(m, 5)] == shard(order, rank, world, False)


def test_a_stream_without_a_share_of_its_own_cannot_span_ranks() -> None:
    m = mix([Stream("s", 5), Squares("b", 4)], [1, 1])
    with pytest.raises(ValueError, match=r"sources\[0\]: a Stream cannot be shared among 2 ranks"):
        Loader(m, rank=0, world_size=2)


# -- many ranks, and resumes on another world size ----------------------------------------------------


def universe(kind: str) -> set[tuple[int, int, str]]:
    first = A if kind == "lists" else TAR
    return {(0, 0, a) for a in first} | {(1, 0, b) for b in B}


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("kind", ["lists", "tar"])
def test_every_rank_takes_the_same_number_of_steps(kind: str, shards: list[str], stop: str) -> None:
    steps = []
    for rank in range(4):
        with make(kind, shards, stop, rank, 4) as loader:
            steps.append(sum(1 for _ in loader))
    assert len(set(steps)) == 1


@pytest.mark.parametrize("new_world", [3, 5])
@pytest.mark.parametrize("kind", ["lists", "tar"])
def test_elastic_resume_delivers_each_remaining_sample_once(
    kind: str, shards: list[str], new_world: int
) -> None:
    """With stop="all_exhausted" every sample of each source's first epoch comes in the mix's
    epoch: before the resume or after it, once (but for the padding of the new ranks' shares)."""
    delivered: list[tuple[int, int, str]] = []
    states = []
    for rank in range(4):
        with make(kind, shards, "all_exhausted", rank, 4) as loader:
            it = iter(loader)
            delivered += [s for _ in range(3) for s in next(it)]
            states.append(json.loads(json.dumps(loader.state_dict())))
            it.close()  # type: ignore[attr-defined]
    assert (states[3]["rank"], states[3]["world_size"]) == (3, 4)
    rest = []
    for rank in range(new_world):
        with make(kind, shards, "all_exhausted", rank, new_world) as loader:
            loader.load_state_dict(states)
            rest.append([s for batch in loader for s in batch])
    assert len({len(r) for r in rest}) == 1, "every new rank takes the same number of samples"
    after = [s for r in rest for s in r]
    assert not set(after) & set(delivered)  # none delivered again
    first_epochs = [s for s in delivered + after if s[1] == 0]
    assert set(first_epochs) == universe(kind)  # none lost
    twice = Counter(first_epochs) - Counter(set(first_epochs))
    assert all(n < new_world for n in Counter(s[0] for s in twice.elements()).values())


@pytest.mark.parametrize("new_world", [3, 5])
def test_elastic_resume_ending_at_the_first_exhausted_repeats_nothing(
    shards: list[str], new_world: int
) -> None:
    delivered = []
    states = []
    for rank in range(4):
        with make("tar", shards, "first_exhausted", rank, 4) as loader:
            it = iter(loader)
            delivered += [s for _ in range(2) for s in next(it)]
            states.append(loader.state_dict())
            it.close()  # type: ignore[attr-defined]
    after = []
    for rank in range(new_world):
        with make("tar", shards, "first_exhausted", rank, new_world) as loader:
            loader.load_state_dict(states)
            after += [s for batch in loader for s in batch]
    assert not set(after) & set(delivered)
    assert after  # the epoch went on
    left_b = set(B) - {s[2] for s in delivered if s[0] == 1}
    assert {s[2] for s in after if s[0] == 1} == left_b  # the source that ran out: all of it


def uninterrupted(kind: str, shards: list[str], stop: str, world: int) -> Counter[Any]:
    """Every delivery of one epoch on `world` ranks, none of them stopped."""
    got: Counter[Any] = Counter()
    for rank in range(world):
        with make(kind, shards, stop, rank, world) as loader:
            got.update(s for batch in loader for s in batch)
    return got


@pytest.mark.parametrize(
    "worlds",
    [(4, 3, 3), pytest.param((4, 5), marks=pytest.mark.slow),
     pytest.param((4, 3, 5), marks=pytest.mark.slow)],
)  # fmt: skip
@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("kind", ["lists", "tar"])
def test_elastic_resume_gives_the_uninterrupted_epoch_once(
    kind: str, shards: list[str], stop: str, worlds: tuple[int, ...]
) -> None:
    """Ranks stop after 3 batches, and each world after the first loads every old rank's state:
    what all of them deliver is the epoch the first world would have delivered uninterrupted,
    each sample (source, its epoch, name) once but for the padding of the shares. (Before the
    elastic rule, 4 -> 3 lost 19 of 400 samples of two lists, 4 -> 5 lost 69 and repeated 2.)"""
    want = uninterrupted(kind, shards, stop, worlds[0])
    got: Counter[Any] = Counter()
    states: list[Any] = []
    for step, world in enumerate(worlds):
        last = step == len(worlds) - 1
        steps, saved = [], []
        for rank in range(world):
            with make(kind, shards, stop, rank, world) as loader:
                if states:
                    loader.load_state_dict(states)
                it = iter(loader)
                taken = list(it) if last else [next(it) for _ in range(3)]
                steps.append(len(taken))
                got.update(s for batch in taken for s in batch)
                saved.append(json.loads(json.dumps(loader.state_dict())))
                it.close()  # type: ignore[attr-defined]
        assert len(set(steps)) == 1, f"world {world}: every rank the same number of steps"
        states = saved
    assert set(got) == set(want)  # nothing lost, nothing from beyond the epoch
    # repeats: the shares' padding only, at most world - 1 a source's pass (two passes at most
    # here) for the first world and for each world resumed
    repeats = got - Counter(set(got))
    assert sum(repeats.values()) <= sum((w - 1) * 2 * 2 for w in worlds), repeats


def test_a_source_that_cannot_say_its_size_refuses_another_world_size(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(40))}), path, row_group_size=8)

    def loader(rank: int, world: int) -> Loader[Any]:
        both = mix([sources.parquet([str(path)]), A], [1, 1], seed=1)
        return Loader(both, batch_size=4, collate=list, rank=rank, world_size=world)

    states = []
    for rank in range(2):
        with loader(rank, 2) as first:
            it = iter(first)
            next(it)
            states.append(first.state_dict())
            it.close()  # type: ignore[attr-defined]
    with loader(0, 3) as other, pytest.raises(StateError, match="world size 2 cannot resume on 3"):
        other.load_state_dict(states)
