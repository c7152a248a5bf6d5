"""The executor contract: one registry builds executors by name; optional capabilities are read one way."""

from __future__ import annotations

import asyncio
import logging
import sys
import sysconfig
from typing import Any

import pytest

import aioloader
from aioloader._executors import choose
from aioloader._executors.base import (
    Executor,
    InlineExecutor,
    ThreadExecutor,
    stats_of,
    workers_of,
    writes_rows,
)
from aioloader._executors.choose import EXECUTORS, REGISTRY, auto_executor, make_executor
from aioloader._executors.process.executor import ProcessExecutor
from aioloader._util.threads import gil_enabled


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


def _double(x: int) -> int:
    return 2 * x


def test_the_gil_probe_tells_this_interpreter_as_it_is() -> None:
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    assert gil_enabled() is (sys._is_gil_enabled() if free_threaded else True)


@pytest.mark.parametrize("gil", [True, False])
def test_auto_picks_threads_where_the_gil_is_off_and_processes_where_it_is_on(
    gil: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(choose, "gil_enabled", lambda: gil)
    offset = 1
    with caplog.at_level(logging.INFO, logger="aioloader"):
        # a decode that pickles runs in processes only with the GIL on
        assert auto_executor(_double) == ("process" if gil else "thread")
        assert auto_executor() == ("process" if gil else "thread")
        # one that does not pickle runs in threads either way; only the GIL build says why
        assert auto_executor(lambda x: x + offset) == "thread"
    assert any("cannot be sent" in r.getMessage() for r in caplog.records) is gil
    executor = make_executor("auto", 2)
    try:
        assert type(executor) is (ProcessExecutor if gil else ThreadExecutor)
        assert workers_of(executor) == 2
    finally:
        executor.close()


def test_a_loader_with_executor_auto_decodes_in_threads_where_the_gil_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(choose, "gil_enabled", lambda: False)
    with aioloader.Loader(range(6), _double, decode=_double, workers=2, batch_size=3) as loader:
        assert type(loader._stages.decoder) is ThreadExecutor
        assert [b.tolist() for b in loader] == [[0, 4, 8], [12, 16, 20]]


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
