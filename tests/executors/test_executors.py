"""The executor contract: one registry builds executors by name; optional capabilities are read one way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aioloader
from aioloader._executors.base import (
    Executor,
    InlineExecutor,
    ThreadExecutor,
    stats_of,
    workers_of,
    writes_rows,
)
from aioloader._executors.choose import EXECUTORS, REGISTRY, make_executor
from aioloader._executors.process.executor import ProcessExecutor


def test_executor_is_public() -> None:
    assert aioloader.Executor is Executor


def test_every_name_is_in_the_registry() -> None:
    assert set(EXECUTORS) == {*REGISTRY, "auto"}
    executor = make_executor("inline", None)
    assert isinstance(executor, InlineExecutor)
    threads = make_executor("thread", 3)
    try:
        assert isinstance(threads, ThreadExecutor)
        assert workers_of(threads) == 3
    finally:
        threads.close()


def test_an_unknown_name_says_which_exist() -> None:
    with pytest.raises(ValueError, match="inline"):
        make_executor("gpu", None)


class Minimal:
    """An executor with only what is required."""

    async def run(self, fn: Any, arg: Any, seed: int | None = None) -> Any:
        return fn(arg)

    def close(self) -> None:
        pass


def test_optional_capabilities_have_defaults() -> None:
    minimal = Minimal()
    assert workers_of(minimal) == 1
    assert workers_of(minimal, None) is None
    assert stats_of(minimal) is None
    assert not writes_rows(minimal)
    assert writes_rows(ProcessExecutor.__new__(ProcessExecutor))


def test_a_minimal_executor_runs_a_loader() -> None:
    async def fetch(i: int) -> int:
        return i

    with aioloader.Loader(range(4), fetch, decode=abs, executor=Minimal(), batch_size=2) as loader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert asyncio.run(Minimal().run(abs, -2)) == 2
