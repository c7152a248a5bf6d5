"""The source protocol's optional hooks: which sources have which, and how the loader tells."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import aioloader.sources
from aioloader import Loader
from aioloader._executors.base import (
    HasWorkers,
    InlineExecutor,
    ThreadExecutor,
    stats_of,
    workers_of,
)
from aioloader._protocol import (
    Bindable,
    HasAclose,
    HasDigest,
    HasEtag,
    HasSetEpoch,
    HasSize,
    HasStats,
    SaysHowItShuffles,
    ShufflesItself,
    Source,
)
from aioloader.sources import files, http, s3, tar_shards

HOOKS = (Bindable, HasEtag, HasSetEpoch, HasSize, HasStats, SaysHowItShuffles, ShufflesItself)


def hooks_of(obj: object) -> set[str]:
    return {hook.__name__ for hook in HOOKS if isinstance(obj, hook)}


def test_the_package_exports_the_protocol_it_declares() -> None:
    assert aioloader.sources.Source is Source


def test_each_source_has_the_hooks_it_implements(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"a")
    assert hooks_of(files(tmp_path)) == {"HasSize"}
    assert hooks_of(http("http://127.0.0.1:1/", ["a"])) == {"HasStats"}
    bucket = s3("s3://bucket/", ["a"], endpoint_url="http://127.0.0.1:1", anonymous=True)
    assert hooks_of(bucket) == {"HasSize", "HasEtag", "HasStats"}
    shards = tar_shards(["a.tar"])
    assert hooks_of(shards) == {"Bindable", "HasSetEpoch", "HasStats", "ShufflesItself"}


class Plain:
    """A source with no hook; the subclasses below add one each, in the ways an object can."""

    def __init__(self, n: int = 4) -> None:
        self._keys = list(range(n))

    def keys(self) -> Sequence[int]:
        return self._keys

    async def fetch(self, key: int) -> int:
        return key

    async def aclose(self) -> None:
        pass


class NoneHooks(Plain):
    """Methods set to None: absent, as a getattr probe found them (None)."""

    bind = None
    set_epoch = None
    size = None
    stats = None


class NotCallableStats(Plain):
    """A `stats` that is not callable: the loader reads no counters from it."""

    stats = 3


def test_a_method_set_to_none_is_no_hook() -> None:
    assert hooks_of(NoneHooks()) == set()
    assert isinstance(NoneHooks(), Source)


@pytest.mark.in_process
def test_hooks_set_on_the_instance_count() -> None:
    calls: list[Any] = []
    src = Plain()
    src.set_epoch = lambda epoch: calls.append(epoch)  # type: ignore[attr-defined]
    assert hooks_of(src) == {"HasSetEpoch"}
    with Loader(src, batch_size=2, collate=None) as loader:
        list(loader)
    assert calls == [0]


def test_the_loader_skips_absent_and_not_callable_hooks() -> None:
    for src in (Plain(), NoneHooks(), NotCallableStats()):
        with Loader(src, batch_size=2, collate=None) as loader:
            assert [s for batch in loader for s in batch] == [0, 1, 2, 3]
            assert "retries" not in loader.stats().extra


def test_a_mix_skips_a_not_callable_stats() -> None:
    mixed = aioloader.mix({"a": NotCallableStats(), "b": Plain()}, {"a": 1.0, "b": 1.0})
    assert mixed.stats() == {"retries": 0.0, "throttles": 0.0}


@pytest.mark.in_process
def test_a_bound_source_shards_itself(tmp_path: Path) -> None:
    bound: list[tuple[int, int]] = []

    class Sharding(Plain):
        def bind(self, *, rank: int, world_size: int) -> None:
            bound.append((rank, world_size))

    with Loader(Sharding(), batch_size=2, collate=None, rank=1, world_size=2) as loader:
        # the source was given the rank; the loader's order then holds every key
        assert [s for batch in loader for s in batch] == [0, 1, 2, 3]
    assert bound == [(1, 2)]


def test_a_source_that_shuffles_itself_refuses_the_loaders_shuffle() -> None:
    class Ordered(Plain):
        shuffle = True
        shuffles_how = "its own way"

    class Quiet(Plain):
        shuffle = True

    assert hooks_of(Ordered()) == {"ShufflesItself", "SaysHowItShuffles"}
    with pytest.raises(ValueError, match="its own way"):
        Loader(Ordered(), shuffle=True)
    with pytest.raises(ValueError, match="its shard order every epoch"):
        Loader(Quiet(), shuffle=True)


def test_size_is_what_a_byte_budget_reserves(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    src = files(tmp_path)
    assert isinstance(src, HasSize)
    assert src.size("a.bin") == 3
    assert asyncio.run(src.fetch("a.bin")) == b"abc"


def test_the_hooks_of_a_sources_keys_an_executor_and_a_mixs_inputs() -> None:
    """What the loader checks besides a source's hooks: keys that say their digest (a mix's), an
    executor's `workers` and `stats()`, and an `aclose()` on what a mix holds."""
    both = aioloader.mix([[1, 2], Plain()], [1, 1])
    assert isinstance(both.keys(), HasDigest)
    assert not isinstance([1, 2], HasDigest)
    assert isinstance(Plain(), HasAclose)
    assert not isinstance([1, 2], HasAclose)
    threads, inline = ThreadExecutor(2), InlineExecutor()
    try:
        assert isinstance(threads, HasWorkers)
        assert (workers_of(threads), workers_of(inline)) == (2, 1)
        assert isinstance(threads, HasStats) == (stats_of(threads) is not None)
        assert not isinstance(inline, HasWorkers | HasStats)
    finally:
        threads.close()
