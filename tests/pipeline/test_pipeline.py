"""The pipeline through the loader: concurrency caps, the memory bound, delivery order and errors.

Every behaviour is checked with each face: `for` ("sync"), `async for` on the loader's own loop thread
("async") and `async for` on the caller's loop ("caller").
"""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import (
    WAIT_S,
    AsyncFailing,
    AsyncFetch,
    Boom,
    Failing,
    SyncFetch,
    Tracker,
    consume,
    key_delay,
)

from aioloader import Loader

MODES = ["sync", "async", "caller"]


def make(mode: str, keys: Any, fetch: Any, **kwargs: Any) -> Loader[Any]:
    return Loader(keys, fetch, use_caller_loop=mode == "caller", **kwargs)


def collect(loader: Loader[Any], mode: str) -> list[Any]:
    got: list[Any] = []
    consume(loader, mode, got.append)
    return got


def batches_of(keys: list[int], size: int) -> list[list[int]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


# -- concurrency ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limit", [1, 3, 8])
@pytest.mark.in_process
def test_async_fetch_runs_on_the_loop_at_most_concurrency_at_once(mode: str, limit: int) -> None:
    tracker = Tracker(limit)
    rng = random.Random(limit)
    delays = {k: rng.uniform(0, 0.004) for k in range(48)}
    fetch = AsyncFetch(tracker, delay=key_delay(delays), hold_until_limit=True)
    with make(mode, range(48), fetch, concurrency=limit, batch_size=4, collate=None) as loader:
        got = collect(loader, mode)
    assert got == batches_of(list(range(48)), 4)
    assert tracker.violations == []
    assert tracker.peak == limit  # the cap is real: it was reached, never passed
    assert len(tracker.loops) == 1
    expected_thread = "MainThread" if mode == "caller" else "aioloader-loop"
    assert tracker.threads == {expected_thread}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("limit", [1, 3, 6])
@pytest.mark.in_process
def test_plain_fetch_runs_in_a_pool_of_concurrency_threads(mode: str, limit: int) -> None:
    tracker = Tracker(limit)
    rng = random.Random(limit)
    delays = {k: rng.uniform(0, 0.004) for k in range(36)}
    fetch = SyncFetch(tracker, delay=key_delay(delays), hold_until_limit=True)
    # no byte budget: with one, the first fetch would go alone until a first size is known, and
    # these fetches wait until `limit` of them run at once
    loader = make(
        mode, range(36), fetch, concurrency=limit, batch_size=3, collate=None,
        max_bytes_in_flight=None,
    )  # fmt: skip
    with loader:
        got = collect(loader, mode)
    assert got == batches_of(list(range(36)), 3)
    assert tracker.violations == []
    assert tracker.peak == limit
    assert tracker.loops == set()  # not on an event loop
    assert len(tracker.threads) == limit
    assert all(name.startswith("aioloader-fetch") for name in tracker.threads), tracker.threads


# -- memory bound ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize(
    ("batch_size", "prefetch", "concurrency"), [(4, 2, 3), (None, 3, 2), (2, 1, 5), (3, 2, 1)]
)
@pytest.mark.parametrize("kind", ["async", "plain"])
@pytest.mark.in_process
def test_samples_held_never_exceed_prefetch_batches_plus_concurrency(
    kind: str, batch_size: int | None, prefetch: int, concurrency: int, in_order: bool
) -> None:
    """Held: fetched (or being fetched) but not yet handed to the consumer."""
    n = 60
    bound = prefetch * (batch_size or 1) + concurrency
    tracker = Tracker()
    fetch = (AsyncFetch if kind == "async" else SyncFetch)(tracker)
    delivered = 0
    held: list[int] = []
    with Loader(
        range(n), fetch, batch_size=batch_size, prefetch=prefetch, concurrency=concurrency,
        in_order=in_order, collate=None,
    ) as loader:  # fmt: skip
        for batch in loader:
            delivered += len(batch) if batch_size else 1
            # a slow consumer: let the pipeline run ahead as far as it will before the next batch
            full = min(n, delivered + bound)
            assert tracker.wait_for(lambda t, full=full: t.started >= full), (delivered, full)
            time.sleep(0.002)
            held.append(tracker.started - delivered)
    assert delivered == n
    assert max(held) == bound, held  # reached (the pipeline does run ahead) and never passed


@pytest.mark.in_process
def test_reorder_buffer_counts_against_the_bound() -> None:
    """With the first key stuck, in-order delivery buffers what follows; that is bounded too."""
    stuck = threading.Event()
    tracker = Tracker()

    def fetch(key: int) -> int:
        tracker.enter(key)
        try:
            if key == 0:
                assert stuck.wait(WAIT_S)
            return key
        finally:
            tracker.exit()

    started_while_stuck: list[int] = []

    def release() -> None:
        tracker.wait_for(lambda t: t.started >= 2 * 4 + 3)
        time.sleep(0.05)  # room to overshoot, were the bound not kept
        started_while_stuck.append(tracker.started)
        stuck.set()

    with Loader(range(100), fetch, batch_size=4, prefetch=2, concurrency=3, collate=None) as loader:
        it = iter(loader)
        releaser = threading.Thread(target=release)
        releaser.start()
        first = next(it)
        releaser.join()
        rest = list(it)
    assert started_while_stuck == [2 * 4 + 3]
    assert [first, *rest] == batches_of(list(range(100)), 4)


# -- order ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["async", "plain"])
@pytest.mark.in_process
def test_in_order_delivers_key_order_whatever_the_delays(mode: str, kind: str) -> None:
    rng = random.Random(1234)
    delays = {k: rng.uniform(0, 0.01) for k in range(40)}
    done: list[int] = []
    fetch = (AsyncFetch if kind == "async" else SyncFetch)(
        delay=key_delay(delays), transform=lambda key: done.append(key) or key
    )
    with make(mode, range(40), fetch, batch_size=4, concurrency=8, collate=None) as loader:
        assert collect(loader, mode) == batches_of(list(range(40)), 4)
        assert collect(loader, mode) == batches_of(list(range(40)), 4)
    assert done != sorted(done)  # fetches did finish out of order: the loader put them back


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.in_process
def test_out_of_order_delivers_ready_batches_first_and_every_key_once(mode: str) -> None:
    first_delivered = threading.Event()

    def fetch(key: int) -> int:
        if key == 0:  # adversarial: the first key is the slowest, until a batch has gone out
            assert first_delivered.wait(WAIT_S), "no batch went out while key 0 was stuck"
        return key

    got: list[list[int]] = []

    def step(batch: list[int]) -> None:
        got.append(batch)
        first_delivered.set()

    with make(
        mode, range(30), fetch, batch_size=3, concurrency=4, in_order=False, collate=None
    ) as loader:
        consume(loader, mode, step)
        first_delivered.clear()
        got_first_epoch, got[:] = list(got), []
        consume(loader, mode, step)
    expected = batches_of(list(range(30)), 3)
    for epoch in (got_first_epoch, got):
        assert epoch[0] != [0, 1, 2]  # batches went out before the stuck one
        assert sorted(epoch) == expected  # the same batches, each key exactly once


@pytest.mark.parametrize("mode", MODES)
def test_out_of_order_with_random_delays_still_yields_each_key_once(mode: str) -> None:
    rng = random.Random(99)
    delays = {k: rng.uniform(0, 0.01) for k in range(41)}
    fetch = AsyncFetch(delay=key_delay(delays))
    with make(mode, range(41), fetch, batch_size=5, in_order=False, collate=None) as loader:
        got = collect(loader, mode)
    assert sorted(got) == batches_of(list(range(41)), 5)


# -- errors ---------------------------------------------------------------------------------------

# 12 keys in batches of 3; key 7 (batch 2) fails, and fast, while the keys before it are slow.
SLOW_BEFORE_FAILING = key_delay({k: 0.03 for k in range(6)})


def failing_loader(mode: str, stage: str, *, in_order: bool = True) -> Loader[Any]:
    fetch: Any = AsyncFetch(delay=SLOW_BEFORE_FAILING)
    kwargs: dict[str, Any] = {"batch_size": 3, "in_order": in_order, "collate": list}
    if stage == "fetch":
        slow = fetch

        async def fetch(key: int) -> int:
            await AsyncFailing({7})(key)
            return await slow(key)  # type: ignore[no-any-return]

    elif stage == "decode":
        kwargs["decode"] = Failing({7})
    elif stage == "collate":
        kwargs["collate"] = Failing(lambda batch: 7 in batch)
    elif stage == "plain fetch":
        fetch = Failing({7})
    return make(mode, range(12), fetch, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ["fetch", "plain fetch", "decode", "collate"])
@pytest.mark.in_process
def test_error_reaches_the_consumer_with_type_traceback_and_note(
    mode: str, stage: str, threads_stopped: Callable[[], list[str]]
) -> None:
    got: list[Any] = []
    with failing_loader(mode, stage) as loader:
        with pytest.raises(Boom) as info:
            consume(loader, mode, got.append)
        assert got == [[0, 1, 2], [3, 4, 5]]  # the batches before the failing one came first
        # the loader is not broken: the next epoch runs (and fails at the same place) again
        got.clear()
        with pytest.raises(Boom):
            consume(loader, mode, got.append)
        assert got == [[0, 1, 2], [3, 4, 5]]
    assert threads_stopped() == []  # and closing after the error stops everything
    error = info.value
    frames = traceback.extract_tb(error.__traceback__)
    assert any(f.filename.endswith("fakes.py") and f.name == "__call__" for f in frames)
    notes = getattr(error, "__notes__", [])
    stage_name = stage.split()[-1]
    if stage == "collate":
        assert any(f"'{stage_name}'" in n and "[6, 7, 8]" in n for n in notes), notes
    else:
        assert any(f"'{stage_name}'" in n and "key 7" in n for n in notes), notes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ["fetch", "decode", "collate"])
def test_error_out_of_order_still_reaches_the_consumer(mode: str, stage: str) -> None:
    got: list[Any] = []
    with failing_loader(mode, stage, in_order=False) as loader, pytest.raises(Boom):
        consume(loader, mode, got.append)
    assert [7 in batch for batch in got] == [False] * len(got)


@pytest.mark.parametrize("mode", MODES)
def test_error_while_reading_the_keys_reaches_the_consumer(mode: str) -> None:
    def keys() -> Any:
        yield from range(5)
        raise Boom("listing failed")

    got: list[Any] = []
    with (
        make(mode, keys(), AsyncFetch(), collate=None) as loader,
        pytest.raises(Boom, match="listing failed") as info,
    ):
        consume(loader, mode, got.append)
    # Samples still in flight when the listing fails are dropped, not delivered.
    assert got == list(range(len(got)))
    assert any("'order'" in note for note in info.value.__notes__)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
@pytest.mark.parametrize("kind", ["async", "plain"])
def test_base_exception_in_fetch_reaches_the_consumer(
    mode: str, error: type[BaseException], kind: str
) -> None:
    """A fetch that calls sys.exit() ends the consumer, not the loader's event loop."""

    def plain(key: int) -> int:
        if key == 3:
            raise error("from fetch")
        return key

    async def asynchronous(key: int) -> int:
        return plain(key)

    got: list[Any] = []
    with make(mode, range(6), asynchronous if kind == "async" else plain, timeout=WAIT_S) as loader:
        with pytest.raises(error) as info:
            consume(loader, mode, got.append)
        assert got == [0, 1, 2]
        assert any("key 3" in note for note in info.value.__notes__)
        if mode != "caller":  # the loader's own loop survived it: the next epoch runs
            with pytest.raises(error):
                consume(loader, mode, got.append)
