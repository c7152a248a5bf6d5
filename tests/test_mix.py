"""aioloader.mix: proportions, determinism whatever the timing, stop modes, exact resume, errors."""

from __future__ import annotations

import asyncio
import io
import random
import tarfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import Boom, cancel_after_first
from support.faultproxy import Origin
from torch.utils.data import DistributedSampler

from aioloader import FetchError, Loader, Mix, MixedLoaders, MixKey, StateError, mix, sources
from aioloader._pipeline.order import shard

WEIGHTS = [0.6, 0.3, 0.1]


class Squares:
    """A map-style dataset (no keys of its own): item i is (name, i * i)."""

    def __init__(self, name: str, n: int, bad: int | None = None) -> None:
        self.name, self.n, self.bad = name, n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[str, int]:
        if i == self.bad:
            raise Boom(f"no item {i}")
        return self.name, i * i


class Stream:
    """An iterable of samples that starts again each time it is iterated (an IterableDataset)."""

    def __init__(self, name: str, n: int, fail_at: int | None = None) -> None:
        self.name, self.n, self.fail_at = name, n, fail_at

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for i in range(self.n):
            if i == self.fail_at:
                raise Boom(f"stream broke at {i}")
            yield self.name, i


class SlowStream:
    """An async iterable of samples, each after a random delay (its own RNG: the timing varies)."""

    def __init__(self, name: str, n: int, max_delay: float = 0.002) -> None:
        self.name, self.n, self.max_delay = name, n, max_delay

    async def __aiter__(self) -> AsyncIterator[tuple[str, int]]:
        for i in range(self.n):
            await asyncio.sleep(random.random() * self.max_delay)
            yield self.name, i


class SlowSource:
    """A Source with a length whose fetch takes a random time."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def keys(self) -> list[int]:
        return list(range(self.n))

    async def fetch(self, key: int) -> tuple[str, int]:
        await asyncio.sleep(random.random() * 0.003)
        return self.name, key

    async def aclose(self) -> None:
        pass


def label(sample: Any) -> str:
    """A module-level decode (pickles to worker processes): the sample as text."""
    return f"{sample[0]}:{sample[1]}"


def three(stop: str = "all_exhausted", seed: int = 5) -> Mix:
    """A map-style dataset, a list and a re-iterable stream, mixed."""
    return mix(
        {"sq": Squares("sq", 40), "list": [("list", i) for i in range(25)], "st": Stream("st", 15)},
        {"sq": 3, "list": 2, "st": 1}, seed=seed, stop=stop,
    )  # fmt: skip


def batches(loader: Loader[Any], n: int | None = None) -> list[Any]:
    """The first `n` batches of the loader's next epoch (all of them when None)."""
    out: list[Any] = []
    if n == 0:
        return out
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def stream_keys(m: Mix, epoch: int, n: int | None = None) -> list[MixKey]:
    """The first `n` keys of `epoch` (all of them when None), straight from the mix's stream."""

    async def run() -> list[MixKey]:
        out: list[MixKey] = []
        stream = m.stream(epoch)
        try:
            async for key in stream:
                out.append(key)
                if len(out) == n:
                    break
        finally:
            await stream.aclose()
            await m.aclose()
        return out

    return asyncio.run(run())


# -- proportions ---------------------------------------------------------------------------------------


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


# -- resume -------------------------------------------------------------------------------------------


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


def test_a_dataset_with_its_sampler_takes_the_samplers_order_per_own_epoch() -> None:
    data = Squares("d", 6)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4)
    m = mix({"d": (data, sampler), "l": [("l", i) for i in range(50)]}, [1, 1], stop="cycle")
    keys = [k for k in stream_keys(m, 2, 60) if k.name == "d"]
    for e in (2, 3):
        sampler.set_epoch(e)
        assert [k.key for k in keys if k.epoch == e] == list(sampler)

    def loader() -> Loader[Any]:
        pair = (data, DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4))
        return Loader(mix({"d": pair, "l": list(range(9))}, [1, 2], stop="cycle"), batch_size=4,
                      collate=None)  # fmt: skip

    with loader() as a:
        whole = batches(a, 20)
    with loader() as b:
        head = batches(b, 7)
        state = b.state_dict()
    with loader() as c:
        c.load_state_dict(state)
        assert head + batches(c, 13) == whole


# -- tar shards in a mix ------------------------------------------------------------------------------


def write_shards(folder: Path, shards: int, per_shard: int) -> list[str]:
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                data = f"{s}-{i}".encode()
                info = tarfile.TarInfo(f"s{s}/{i:03d}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def test_tar_shards_mix_and_resume(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, 3, 6)

    def loader() -> Loader[Any]:
        m = mix({"tar": sources.tar_shards(shards, shuffle_buffer=4), "sq": Squares("sq", 12)},
                [1, 1], seed=9, stop="all_exhausted")  # fmt: skip
        return Loader(m, batch_size=4, collate=None, decode=text, concurrency=8)

    with loader() as a:
        whole = batches(a)
    tar = [s for b in whole for s in b if isinstance(s, str)]
    assert set(tar) == {f"{s}-{i}" for s in range(3) for i in range(6)}  # each ran out once
    assert_resume_continues(loader, whole, 3)


def assert_resume_continues(make: Callable[[], Loader[Any]], whole: list[Any], cut: int) -> None:
    """A loader stopped after `cut` batches and one resumed from its state give `whole`."""
    with make() as b:
        head = batches(b, cut)
        state = b.state_dict()
    with make() as c:
        c.load_state_dict(state)
        assert head + batches(c) == whole


def text(sample: Any) -> Any:
    return sample["txt"].decode() if isinstance(sample, dict) else sample


def test_http_and_files_mix_over_a_real_server(origin: Origin, objects: dict[str, bytes],
                                               tmp_path: Path) -> None:  # fmt: skip
    for i in range(12):
        (tmp_path / f"{i:02d}.txt").write_bytes(f"file {i}".encode())
    names = sorted(objects)[:20]

    def loader(keys: list[str]) -> Loader[Any]:
        web = sources.http(origin.url + "/", keys=keys, attempts=1)
        m = mix(
            {"web": web, "disk": sources.files(tmp_path, "*.txt")}, [1, 1], stop="all_exhausted"
        )
        return Loader(m, batch_size=4, collate=None, concurrency=8)

    with loader(names) as a:
        got = [s for b in batches(a) for s in b]
    assert sorted(s for s in got if not s.startswith(b"file")) == sorted(objects[n] for n in names)
    assert {s for s in got if s.startswith(b"file")} == {f"file {i}".encode() for i in range(12)}
    with loader([*names, "obj/missing.bin"]) as b, pytest.raises(FetchError) as info:
        batches(b)
    assert "sources['web'] failed to fetch key 'obj/missing.bin'" in str(info.value)
    assert isinstance(info.value.__cause__, FetchError)  # the http source's own, with the status


# -- ranks --------------------------------------------------------------------------------------------


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


# -- errors, early ends -------------------------------------------------------------------------------


def test_a_failing_fetch_is_a_fetch_error_naming_the_source_and_key() -> None:
    m = mix(
        {"good": Squares("g", 10), "bad": Squares("b", 10, bad=3)}, [1, 1], stop="all_exhausted"
    )
    with Loader(m, batch_size=2) as loader, pytest.raises(FetchError) as info:
        batches(loader)
    assert "sources['bad'] failed to fetch key 3" in str(info.value)
    assert isinstance(info.value.key, MixKey)
    assert info.value.key.name == "bad"
    assert isinstance(info.value.__cause__, Boom)


def test_a_failing_stream_is_a_fetch_error_naming_the_source() -> None:
    m = mix([Squares("g", 50), Stream("s", 10, fail_at=4)], [1, 1], stop="cycle")
    with Loader(m, batch_size=2, collate=None) as loader, pytest.raises(FetchError) as info:
        batches(loader, 100)
    assert "sources[1] failed while giving its keys in its epoch 0, after 4" in str(info.value)
    assert isinstance(info.value.__cause__, Boom)


def live_reads(m: Mix) -> int:
    return sum(len(getattr(part, "passes", ())) for part in m.parts)


def test_early_break_stops_the_reads(wait_until: Callable[..., bool]) -> None:
    m = mix([SlowStream("s", 10_000), Stream("t", 10_000)], [1, 1], stop="cycle")
    with Loader(m, batch_size=4, collate=None) as loader:
        assert len(batches(loader, 3)) == 3
        assert wait_until(lambda: live_reads(m) == 0)
    assert live_reads(m) == 0


@pytest.mark.asyncio
async def test_cancelling_the_consumer_leaves_nothing_running(
    caller_tasks_left: Callable[..., Any],
) -> None:
    before = asyncio.all_tasks()
    m = mix([SlowStream("s", 10_000), Squares("q", 100)], [1, 1], stop="cycle")
    loader = Loader(m, batch_size=4, collate=None, use_caller_loop=True)
    await cancel_after_first(loader)
    await loader.aclose()
    assert await caller_tasks_left(before) == set()
    assert live_reads(m) == 0


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "match"),
    [
        ([1, -1], {}, ValueError, r"weights\[1\]: must be finite and >= 0, got -1"),
        ([0, 0], {}, ValueError, "weights: all are zero"),
        ([1, 2, 3], {}, ValueError, "weights: 3 weights for 2 sources"),
        ([1, float("nan")], {}, ValueError, r"weights\[1\]: must be finite"),
        ([1, "2"], {}, TypeError, r"weights\[1\]: expected a number"),
        ([1, True], {}, TypeError, r"weights\[1\]: expected a number"),
        ({"x": 1}, {}, ValueError, "weights: a mapping needs the sources' names"),
        ([1, 1], {"stop": "longest"}, ValueError, "stop: expected one of"),
        ([1, 1], {"seed": -1}, ValueError, "seed must be >= 0"),
        ([1, 1], {"shuffle": "yes"}, TypeError, "shuffle: expected True or False"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(
    weights: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        mix([[1], [2]], weights, **kwargs)


def test_a_loader_over_a_mix_leaves_the_shuffle_to_it() -> None:
    with pytest.raises(ValueError, match=r"shuffles itself \(the choices from \(seed, epoch"):
        Loader(mix([[1], [2]], [1, 1]), shuffle=True)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(TypeError, match=r"sources\[1\]: expected a source"):
        mix([[1], "abc"], [1, 1])
    with pytest.raises(ValueError, match=r"sources\['e'\]: it has no samples"):
        mix({"a": [1], "e": []}, {"a": 1, "e": 1})
    with pytest.raises(ValueError, match="sources_or_loaders: nothing to mix"):
        mix([], [])
    with Loader(range(3), fetch=label) as loader, pytest.raises(TypeError, match="is a Loader"):
        mix([loader, [1]], [1, 1])


# -- loaders mixed whole ------------------------------------------------------------------------------


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


def test_a_state_of_other_loaders_weights_is_refused() -> None:
    with two_loaders() as both:
        state = both.state_dict()
    a, b = (Loader(Squares(n, 4), batch_size=2) for n in "ab")
    with mix([a, b], [1, 1], seed=6, stop="all_exhausted") as other:
        with pytest.raises(StateError) as info:
            other.load_state_dict(state)
        assert info.value.field == "weights"


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


def test_parquet_mixes_and_resumes(tmp_path: Path) -> None:
    """A Parquet source in a mix: every row once per epoch of it, and a resume that continues
    the exact sequence (its rows come through `sources.parquet`'s own keys)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i in range(2):
        path = tmp_path / f"part-{i}.parquet"
        table = pa.table({"id": [f"pq-{i * 40 + j}" for j in range(40)]})
        pq.write_table(table, path, row_group_size=7)
        paths.append(str(path))

    def loader() -> Loader[Any]:
        m = mix({"pq": sources.parquet(paths, ["id"]), "sq": Squares("sq", 30)}, [2, 1],
                seed=4, stop="all_exhausted")  # fmt: skip
        return Loader(m, batch_size=5, collate=None, concurrency=6)

    with loader() as a:
        whole = batches(a)
    rows = [s["id"] for b in whole for s in b if isinstance(s, dict)]
    assert sorted(rows, key=lambda r: int(r[3:])) == [f"pq-{i}" for i in range(80)]
    assert_resume_continues(loader, whole, 4)
