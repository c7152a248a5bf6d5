"""Fixtures for the executors' tests: `pool`, one process pool per module for the tests that do not
break it, and `make`, pools a test makes for itself (closed after it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.workerfuncs import (
    WAIT_S,
)

from aioloader._executors.process.executor import ProcessExecutor


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessExecutor]:
    executor = ProcessExecutor(2)
    executor.wait_ready(WAIT_S)
    yield executor
    executor.close()


@pytest.fixture
def make() -> Iterator[Callable[..., ProcessExecutor]]:
    made: list[ProcessExecutor] = []

    def make(workers: int = 1, **kwargs: Any) -> ProcessExecutor:
        executor = ProcessExecutor(workers, **kwargs)
        made.append(executor)
        executor.wait_ready(WAIT_S)
        return executor

    yield make
    for executor in made:
        executor.close()
