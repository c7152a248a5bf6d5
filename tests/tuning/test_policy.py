"""Error policy (on_error / max_skipped) and bad arguments: typed errors, nothing else lost."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import numpy as np
import pytest

from aioloader import CollateError, Loader, LoaderTimeout


def failing_on(bad: set[int]) -> Any:
    async def fetch(key: int) -> np.ndarray:
        await asyncio.sleep(0)
        if key in bad:
            raise OSError(f"cannot read {key}")
        return np.full(2, key)

    return fetch


def test_skip_drops_failed_samples_and_lists_them() -> None:
    bad = {3, 4, 17}
    with Loader(
        list(range(20)), failing_on(bad), batch_size=4, on_error="skip", max_skipped=3
    ) as ld:
        batches = list(ld)
        stats = ld.stats()
    delivered = [int(x) for b in batches for x in b[:, 0]]
    assert delivered == [k for k in range(20) if k not in bad]  # the others, in order
    assert stats.skipped_count == 3
    assert sorted(k for k, _ in stats.skipped) == sorted(bad)
    assert all("OSError: cannot read" in reason for _, reason in stats.skipped)
    assert stats.stages["fetch"].skipped == 3


def test_skip_budget_spent_raises_the_sample_error() -> None:
    bad = {1, 5, 9}
    with Loader(
        list(range(12)), failing_on(bad), batch_size=2, on_error="skip", max_skipped=2
    ) as ld:
        batches = iter(ld)
        got = [
            next(batches) for _ in range(4)
        ]  # keys 0, 2-3, 4+6? no: groups [0,1] [2,3] [4,5] [6,7]
        with pytest.raises(OSError, match="cannot read 9") as err:
            next(batches)
    assert [len(b) for b in got] == [1, 2, 1, 2]
    assert any("max_skipped=2 is spent" in n for n in err.value.__notes__)
    assert any("key 9" in n for n in err.value.__notes__)


def test_the_fault_that_spends_the_budget_is_the_first_in_key_order_not_in_time() -> None:
    # key 1 fails only once key 9 has failed: counted as they end, key 9 would be the skip and key
    # 1 the fault past the budget, failing the first batch; counted in key order, the first four
    # batches come and key 9's is the error, whichever fault ended first
    nine_failed = asyncio.Event()

    async def fetch(key: int) -> np.ndarray:
        if key == 1:
            await asyncio.wait_for(nine_failed.wait(), 60)  # (a bound only: it comes at once)
            raise OSError("cannot read 1")
        await asyncio.sleep(0)
        if key == 9:
            nine_failed.set()
            raise OSError("cannot read 9")
        return np.full(2, key)

    with Loader(list(range(12)), fetch, batch_size=2, on_error="skip", max_skipped=1,
                concurrency=12, prefetch=8) as ld:  # fmt: skip
        batches = iter(ld)
        got = [next(batches) for _ in range(4)]  # [0] [2, 3] [4, 5] [6, 7]
        with pytest.raises(OSError, match="cannot read 9") as err:
            next(batches)
        stats = ld.stats()
    assert [[int(x) for x in b[:, 0]] for b in got] == [[0], [2, 3], [4, 5], [6, 7]]
    assert any("max_skipped=1 is spent" in n for n in err.value.__notes__)
    assert [k for k, _ in stats.skipped] == [1]


def test_skip_budget_as_a_fraction_of_the_epoch() -> None:
    bad = set(range(0, 100, 10))  # 10 % of the epoch
    ok = Loader(list(range(100)), failing_on(bad), batch_size=10, on_error="skip", max_skipped=0.1)
    with ok:
        assert sum(len(b) for b in ok) == 90
    tight = Loader(
        list(range(100)), failing_on(bad), batch_size=10, on_error="skip", max_skipped=0.05
    )
    with tight, pytest.raises(OSError, match="cannot read"):
        list(tight)


def test_a_batch_whose_samples_all_fail_is_skipped_whole() -> None:
    with Loader(
        list(range(6)), failing_on({2, 3}), batch_size=2, on_error="skip", max_skipped=2
    ) as ld:
        assert [b[:, 0].tolist() for b in ld] == [[0, 1], [4, 5]]


def test_collate_failure_names_keys_and_shapes_and_can_be_skipped() -> None:
    def fetch(key: int) -> np.ndarray:
        return np.zeros(3 if key == 5 else 2)

    with Loader(list(range(8)), fetch, batch_size=4) as ld, pytest.raises(CollateError) as err:
        list(ld)
    assert "(2,)" in str(err.value)
    assert "(3,)" in str(err.value)
    assert any("keys [4, 5, 6, 7]" in n for n in err.value.__notes__)
    with Loader(list(range(8)), fetch, batch_size=4, on_error="skip", max_skipped=4) as ld:
        batches = list(ld)
        assert len(batches) == 1
        assert ld.stats().skipped_count == 4


def test_raise_is_the_default_and_keeps_the_original_type() -> None:
    with Loader(list(range(4)), failing_on({2}), batch_size=1) as ld:
        it = iter(ld)
        assert next(it).tolist() == [[0, 0]]
        assert next(it).tolist() == [[1, 1]]
        with pytest.raises(OSError, match="cannot read 2"):
            next(it)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=-3), ValueError, "batch_size"),
        (dict(batch_size=2.5), TypeError, "batch_size"),
        (dict(concurrency=0), ValueError, "concurrency"),
        (dict(prefetch=0), ValueError, "prefetch"),
        (dict(executor="gpu"), ValueError, "executor"),
        (dict(workers=0), ValueError, "workers"),
        (dict(timeout=0), ValueError, "timeout"),
        (dict(on_error="ignore"), ValueError, "on_error"),
        (dict(max_skipped=-1), ValueError, "max_skipped"),
        (dict(max_skipped=1.5), ValueError, "max_skipped"),
        (dict(max_bytes_in_flight=0), ValueError, "max_bytes_in_flight"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(decode=3), TypeError, "decode"),
        (dict(collate="stack"), TypeError, "collate"),
        (dict(max_skipped=float("nan")), ValueError, "max_skipped"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], error: type, name: str) -> None:
    with pytest.raises(error, match=name):
        Loader([1, 2, 3], lambda k: k, **kwargs)


def test_missing_fetch_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="fetch"):
        Loader(k for k in range(3))  # keys, not samples: a list would be its own samples


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_timeout_error_from_fetch_is_not_a_loader_timeout(asynchronous: bool) -> None:
    from aioloader import LoaderTimeout

    def fetch(key: int) -> int:
        raise TimeoutError(f"upstream timed out for {key}")

    async def consume() -> None:
        async with Loader([1], fetch, timeout=30) as ld:
            async for _ in ld:
                pass

    def run() -> None:
        if asynchronous:
            asyncio.run(consume())
        else:
            with Loader([1], fetch, timeout=30) as ld:
                list(ld)

    with pytest.raises(TimeoutError, match="upstream") as err:
        run()
    assert not isinstance(err.value, LoaderTimeout)


def test_keys_none_is_a_type_error_naming_keys() -> None:
    with pytest.raises(TypeError, match=r"^keys: expected a sequence"):
        Loader(None, lambda k: k)  # type: ignore[arg-type]


def test_a_whole_float_max_skipped_is_a_count() -> None:
    def fetch(k: int) -> int:
        if k % 2:
            raise ValueError(f"odd {k}")
        return k

    with Loader(range(60), fetch, batch_size=10, on_error="skip", max_skipped=30.0) as loader:
        assert sum(len(b) for b in loader) == 30  # 30 skipped: within a count of 30, not 30x


def test_a_one_shot_iterator_of_keys_refuses_a_second_epoch() -> None:
    with Loader((k for k in range(6)), lambda k: k, batch_size=3) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(ValueError, match=r"keys: a one-shot generator .*used up"):
            list(loader)


def test_a_one_shot_async_iterator_of_keys_refuses_a_second_epoch() -> None:
    async def keys() -> Any:
        for k in range(4):
            yield k

    async def main() -> None:
        async with Loader(keys(), lambda k: k, batch_size=2) as loader:
            assert [b.tolist() async for b in loader] == [[0, 1], [2, 3]]
            with pytest.raises(ValueError, match="keys: a one-shot async_generator"):
                [b async for b in loader]

    asyncio.run(main())


def test_a_decode_that_returns_none_under_skip_costs_that_sample_alone() -> None:
    def decode(k: int) -> int | None:
        return None if k == 3 else k

    loader = Loader(
        range(10), lambda k: k, decode=decode, batch_size=5, on_error="skip", max_skipped=1
    )
    with loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 4], [5, 6, 7, 8, 9]]
        ((key, reason),) = loader.stats().skipped
    assert key == 3
    assert "returned None" in reason


def test_a_timeout_names_the_stuck_stage_and_its_oldest_keys() -> None:
    gate = threading.Event()

    def decode(k: int) -> int:
        if k == 7:
            gate.wait(10)  # one sample stuck in decode
        return k

    loader = Loader(
        range(12), lambda k: k, decode=decode, executor="thread", batch_size=4, timeout=0.5
    )
    with loader, pytest.raises(LoaderTimeout) as info:
        list(loader)
    gate.set()
    assert info.value.stage == "decode"
    assert info.value.keys == [7]
    assert re.search(r"the oldest work is in stage 'decode', keys in flight there: 7 \(0\.\d s\)",
                     str(info.value))  # fmt: skip
