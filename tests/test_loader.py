"""Loader: what it is built from, what it yields, its arguments, epochs and both iteration faces."""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fakes import AsyncFetch, FakeSource, Keys, SyncFetch, plain_square, square

from aioloader import Loader, sources
from aioloader._util.threads import gil_enabled

# -- what a loader is built from ----------------------------------------------------------------


@pytest.mark.parametrize("fetch", [square, plain_square], ids=["async", "plain"])
def test_sequence_of_keys_and_either_kind_of_fetch(fetch: Any) -> None:
    with Loader(range(7), fetch, batch_size=3, collate=None) as loader:
        assert list(loader) == [[0, 1, 4], [9, 16, 25], [36]]


def test_iterable_keys_are_read_in_order_every_epoch() -> None:
    with Loader(Keys(5), square, batch_size=2, collate=None) as loader:
        assert list(loader) == [[0, 1], [4, 9], [16]]
        assert list(loader) == [[0, 1], [4, 9], [16]]


def test_one_shot_iterator_of_keys() -> None:
    with Loader(iter([3, 1, 2]), square, collate=None) as loader:
        assert list(loader) == [9, 1, 4]


@pytest.mark.in_process
def test_source_gives_keys_and_fetch_and_is_closed_with_the_loader() -> None:
    source = FakeSource(5)
    with Loader(source, batch_size=2, collate=None) as loader:
        assert list(loader) == [[0, 10], [20, 30], [40]]
    assert sorted(source.fetched) == [0, 1, 2, 3, 4]
    assert source.closed >= 1


def test_explicit_fetch_overrides_the_sources() -> None:
    source = FakeSource(3)
    with Loader(source, square, collate=None) as loader:
        assert list(loader) == [0, 1, 4]
    assert source.fetched == []


@pytest.mark.in_process
def test_async_callable_object_is_awaited_on_the_loop() -> None:
    fetch = AsyncFetch(transform=lambda key: -key)
    with Loader(range(4), fetch) as loader:
        assert list(loader) == [0, -1, -2, -3]
    assert fetch.tracker.threads == {"aioloader-loop"}


@pytest.mark.in_process
def test_plain_fetch_runs_in_fetch_threads() -> None:
    fetch = SyncFetch(transform=lambda key: -key)
    with Loader(range(4), fetch, concurrency=2) as loader:
        assert list(loader) == [0, -1, -2, -3]
    assert fetch.tracker.threads
    assert all(name.startswith("aioloader-fetch") for name in fetch.tracker.threads)


# -- decode and collate ---------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_decode_is_applied_to_each_sample(executor: str) -> None:
    decoded_on: set[str] = set()

    def decode(raw: int) -> str:
        decoded_on.add(threading.current_thread().name)
        return f"<{raw}>"

    with Loader(range(5), square, decode=decode, executor=executor, workers=2) as loader:
        assert list(loader) == ["<0>", "<1>", "<4>", "<9>", "<16>"]
    expected = "aioloader-loop" if executor == "inline" else "aioloader-decode"
    assert all(name.startswith(expected) for name in decoded_on), decoded_on


def label_and_text(key: str, raw: bytes) -> tuple[str, str]:
    """A decode that takes the label from the key's folder: "cat/001.txt" -> "cat"."""
    return key.split("/")[0], bytes(raw).decode()


def label_row(key: str, raw: bytes) -> torch.Tensor:
    """One tensor per sample (so process workers write batch rows in place): label, then bytes."""
    return torch.tensor([LABELS.index(key.split("/")[0]), *bytes(raw)], dtype=torch.float32)


LABELS = ["cat", "dog"]


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    """cat/000.txt ... dog/002.txt, each holding its own name's number ("c0", "d2", ...)."""
    for label in LABELS:
        (tmp_path / label).mkdir()
        for i in range(3):
            (tmp_path / label / f"{i:03d}.txt").write_bytes(f"{label[0]}{i}".encode())
    return tmp_path


EXPECTED_PAIRS = [(label, f"{label[0]}{i}") for label in LABELS for i in range(3)]


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_decode_with_key_gets_the_files_path(labelled: Path, executor: str) -> None:
    source = sources.files(labelled)
    with Loader(source, decode=label_and_text, decode_with_key=True, executor=executor,
                workers=2, collate=None) as loader:  # fmt: skip
        assert list(loader) == EXPECTED_PAIRS
        assert list(loader) == EXPECTED_PAIRS  # and in the next epoch


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_decode_with_key_into_stacked_batches(labelled: Path, executor: str) -> None:
    # with the default collate, process workers write each row of the batch in place
    with Loader(sources.files(labelled), decode=label_row, decode_with_key=True,
                executor=executor, workers=2, batch_size=3) as loader:  # fmt: skip
        batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0.0] * 3, [1.0] * 3]
    assert bytes(batches[1][2, 1:].to(torch.uint8).tolist()) == b"d2"


def test_decode_with_key_when_workers_fetch(labelled: Path) -> None:
    with Loader(sources.files(labelled), decode=label_and_text, decode_with_key=True,
                executor="process", workers=2, fetch_in_workers=True, collate=None,
                concurrency=4) as loader:  # fmt: skip
        assert list(loader) == EXPECTED_PAIRS
        assert "fetch_in_workers=True, decode=label_and_text (with key)" in repr(loader)


def test_decode_with_key_takes_a_partial_and_a_callable_object() -> None:
    class Tag:
        def __call__(self, key: int, raw: int) -> str:
            return f"{key}:{raw}"

    joined = functools.partial(lambda sep, key, raw: f"{key}{sep}{raw}", "=")
    with Loader(range(3), square, decode=Tag(), decode_with_key=True, collate=None) as loader:
        assert list(loader) == ["0:0", "1:1", "2:4"]
    with Loader(range(3), square, decode=joined, decode_with_key=True, collate=None) as loader:
        assert list(loader) == ["0=0", "1=1", "2=4"]


@pytest.mark.in_process
def test_without_decode_the_raw_sample_is_kept() -> None:
    raw = [object() for _ in range(3)]

    async def fetch(i: int) -> object:
        return raw[i]

    with Loader(range(3), fetch) as loader:
        got = list(loader)
    assert all(a is b for a, b in zip(got, raw, strict=True))


def test_default_collate_stacks_into_tensors() -> None:
    async def fetch(i: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(i)), "y": i}

    with Loader(range(5), fetch, batch_size=2) as loader:
        batches = list(loader)
    assert [b["y"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert torch.equal(batches[1]["x"], torch.tensor([[2.0, 2.0], [3.0, 3.0]]))


def test_collate_none_yields_lists_of_samples() -> None:
    with Loader(range(5), square, batch_size=2, collate=None) as loader:
        batches = list(loader)
    assert batches == [[0, 1], [4, 9], [16]]
    assert all(type(b) is list for b in batches)


@pytest.mark.in_process
def test_user_collate_is_used_as_given() -> None:
    seen: list[list[int]] = []
    made: list[object] = []

    def collate(samples: list[int]) -> object:
        seen.append(list(samples))
        made.append(object())
        return made[-1]

    with Loader(range(5), square, batch_size=2, collate=collate) as loader:
        batches = list(loader)
    assert seen == [[0, 1], [4, 9], [16]]
    assert len(batches) == 3
    assert all(a is b for a, b in zip(batches, made, strict=True))


def test_unbatched_yields_samples_one_by_one() -> None:
    with Loader(range(4), square) as loader:
        samples = list(loader)
        assert len(loader) == 4
    assert samples == [0, 1, 4, 9]
    assert all(type(s) is int for s in samples)


@pytest.mark.parametrize(
    ("drop_last", "expected"),
    [(False, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]), (True, [[0, 1, 2, 3], [4, 5, 6, 7]])],
)
def test_drop_last(drop_last: bool, expected: list[list[int]]) -> None:
    async def fetch(i: int) -> int:
        return i

    with Loader(range(10), fetch, batch_size=4, drop_last=drop_last, collate=None) as loader:
        assert len(loader) == len(expected)
        assert list(loader) == expected


# -- length -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch_size", "drop_last", "length"),
    [(10, None, False, 10), (10, 3, False, 4), (10, 3, True, 3), (9, 3, True, 3), (0, 4, False, 0)],
)
def test_len_of_a_sequence(n: int, batch_size: int | None, drop_last: bool, length: int) -> None:
    with Loader(range(n), square, batch_size=batch_size, drop_last=drop_last) as loader:
        assert len(loader) == length
        assert len(list(loader)) == length


@pytest.mark.parametrize("keys", [Keys(5), iter(range(5))], ids=["iterable", "iterator"])
def test_len_without_a_length_is_a_type_error(keys: Any) -> None:
    with Loader(keys, square, batch_size=2) as loader, pytest.raises(TypeError):
        len(loader)


# -- shuffle and epochs -------------------------------------------------------------------------


def epochs(loader: Loader[Any], count: int) -> list[list[int]]:
    """The samples of `count` full iterations, flattened."""
    flat = lambda batch: batch if isinstance(batch, list) else [batch]  # noqa: E731
    return [[x for batch in loader for x in flat(batch)] for _ in range(count)]


def test_shuffle_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    def make(seed: int) -> Loader[Any]:
        return Loader(range(32), square, batch_size=4, shuffle=True, seed=seed, collate=None)

    with make(7) as a, make(7) as b, make(8) as c:
        first_a, second_a = epochs(a, 2)
        first_b, second_b = epochs(b, 2)
        (first_c,) = epochs(c, 1)
    squares = sorted(k * k for k in range(32))
    assert sorted(first_a) == sorted(second_a) == squares
    assert first_a == first_b  # same seed, same epoch: same order
    assert second_a == second_b
    assert first_a != second_a  # each full iteration moves to the next epoch
    assert first_a != first_c  # another seed, another order
    assert first_a != squares  # it did shuffle


def test_each_iteration_advances_the_epoch_and_set_epoch_picks_it() -> None:
    with Loader(range(32), square, shuffle=True, seed=3, collate=None) as loader:
        assert loader.epoch == 0
        orders = epochs(loader, 3)
        assert loader.epoch == 3
        loader.set_epoch(1)
        assert loader.epoch == 1
        assert epochs(loader, 1) == [orders[1]]
        loader.set_epoch(0)
        assert epochs(loader, 1) == [orders[0]]
    assert len({tuple(o) for o in orders}) == 3


def test_without_shuffle_every_epoch_is_in_key_order() -> None:
    with Loader(range(6), square, collate=None) as loader:
        loader.set_epoch(5)
        assert list(loader) == [0, 1, 4, 9, 16, 25]


# -- invalid arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": -1}, ValueError, "batch_size"),
        ({"batch_size": 2.0}, TypeError, "batch_size"),
        ({"concurrency": 0}, ValueError, "concurrency"),
        ({"concurrency": 2.5}, TypeError, "concurrency"),
        ({"prefetch": 0}, ValueError, "prefetch"),
        ({"workers": 0}, ValueError, "workers"),
        ({"executor": "fork"}, ValueError, "executor"),
        ({"fetch": 42}, TypeError, "fetch"),
        ({"fetch": None}, TypeError, "fetch"),
        ({"decode": "utf-8"}, TypeError, "decode"),
        ({"collate": 42}, TypeError, "collate"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": -1.5}, ValueError, "timeout"),
        ({"timeout": float("nan")}, ValueError, "timeout"),
        ({"timeout": "1"}, TypeError, "timeout"),
        ({"seed": -1}, ValueError, "seed"),
        ({"decode_with_key": True}, ValueError, "decode_with_key"),
        ({"decode_with_key": 1, "decode": str}, TypeError, "decode_with_key"),
        ({"decode_with_key": True, "decode": "utf-8"}, TypeError, "decode"),
        ({"shuffle": True, "keys": iter(range(4))}, ValueError, "shuffle"),
    ],
)
def test_invalid_arguments_raise_at_construction_naming_the_argument(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    args = {"keys": range(4), "fetch": square, **kwargs}
    with pytest.raises(error, match=name) as info:
        Loader(args.pop("keys"), args.pop("fetch"), **args)
    assert type(info.value) is error


@pytest.mark.in_process
def test_repr_shows_the_configuration(labelled: Path) -> None:
    with Loader(sources.files(labelled), decode=label_and_text, decode_with_key=True,
                batch_size=3, shuffle=True, concurrency=8, executor="thread",
                workers=2) as loader:  # fmt: skip
        assert repr(loader) == (
            f"Loader(source=files({str(labelled)!r}, pattern='**/*') [6 files], "
            "decode=label_and_text (with key), batch_size=3, shuffle=True, concurrency=8, "
            "executor='thread', workers=2)"
        )
    assert repr(loader).endswith(", closed)")
    with Loader(range(4), square, concurrency="auto") as loader:
        assert repr(loader) == (
            "Loader(keys=range(0, 4), fetch=square, batch_size=None, shuffle=False, "
            "concurrency='auto', executor='inline')"
        )


def test_repr_of_a_dataloader_shows_torchs_arguments() -> None:
    from aioloader import DataLoader

    with DataLoader(list(range(10)), batch_size=2, shuffle=True) as loader:
        assert repr(loader) == (
            "DataLoader(dataset=<list of 10>, batch_size=2, sampler=RandomSampler, "
            "num_workers=0, concurrency=16)"
        )


def test_set_epoch_rejects_a_negative_epoch() -> None:
    with Loader(range(4), square) as loader, pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)


def _negate(x: int) -> int:
    return -x


@pytest.mark.parametrize("gil", [True, False])
@pytest.mark.in_process
def test_executor_auto_is_processes_with_the_gil_and_threads_without(
    gil: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioloader import ProcessExecutor

    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil, raising=False)
    with Loader(range(4), _negate, decode=_negate, executor="auto", workers=1) as loader:
        assert list(loader) == [0, 1, 2, 3]
        decoder = loader._stages.decoder
        assert isinstance(decoder, ProcessExecutor) is gil
        assert type(decoder).__name__ == ("ProcessExecutor" if gil else "ThreadExecutor")


@pytest.mark.in_process
def test_auto_is_the_default_with_a_decode_and_inline_without(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aioloader import ProcessExecutor

    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    with Loader(range(4), _negate, decode=_negate, workers=1) as loader:
        assert isinstance(loader._stages.decoder, ProcessExecutor)  # decode pickles: processes
        assert list(loader) == [0, 1, 2, 3]
    offset = 10
    with caplog.at_level("INFO", logger="aioloader"):
        lam = Loader(range(4), _negate, decode=lambda x: x + offset)  # a lambda: threads
    with lam as loader:
        assert type(loader._stages.decoder).__name__ == "ThreadExecutor"
        assert list(loader) == [10, 9, 8, 7]
    assert any("cannot be sent to a worker process" in r.getMessage() for r in caplog.records)
    with Loader(range(4), _negate) as loader:  # nothing to decode: nothing to start
        assert type(loader._stages.decoder).__name__ == "InlineExecutor"


def _tensor(key: int) -> torch.Tensor:
    return torch.full((4,), float(key))


FREED_WITHIN_S = 2.0


def _freed(ref: weakref.ref[Any]) -> bool:
    """Whether the object `ref` names is gone now that its last holder dropped it.

    On a free-threaded build an object is owned by the thread that made it (biased reference
    counting), and one dropped for the last time by another thread is freed when its owner next
    runs Python code, or at a collection: a batch made on a pipeline thread outlives the consumer's
    `del` until then. Collections, for up to `FREED_WITHIN_S`, let it go there (on 3.14t one
    collection was not always enough: the owner's queue is merged when the owner runs); a reference
    the loader kept would still hold it."""
    if gil_enabled():
        return ref() is None
    deadline = time.monotonic() + FREED_WITHIN_S
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)  # the owner thread must get to run; nothing signals that it did
    return ref() is None


def test_a_batch_the_consumer_drops_is_freed_at_once() -> None:
    # the iterator keeps no reference to the batch it handed over, so its buffer can be reused
    # while the consumer waits for the next one (a fresh batch each time: the default collate's
    # recycled buffers are kept by its pool on purpose)
    with Loader(range(12), _tensor, batch_size=3, collate=torch.stack) as loader:
        for batch in loader:
            ref = weakref.ref(batch)
            del batch
            assert _freed(ref)

    async def consume() -> None:
        async for batch in loader2:
            ref = weakref.ref(batch)
            del batch
            assert _freed(ref)

    with Loader(range(12), _tensor, batch_size=3, collate=torch.stack) as loader2:
        asyncio.run(consume())
