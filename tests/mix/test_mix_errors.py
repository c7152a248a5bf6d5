"""aioloader.mix when things go wrong: a failing fetch or stream named, an early break or a cancelled
consumer that leaves no read running, bad arguments and inputs named."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import Boom, cancel_after_first
from support.mixes import SlowStream, Squares, Stream, batches, label

from aioloader import FetchError, Loader, Mix, MixKey, mix


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
