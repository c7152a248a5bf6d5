"""Fixtures for the pipeline's tests: `make_stage`, a DeviceStage on a fake CUDA backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.fakecuda import FakeBackend

from aioloader._pipeline.transfer import DeviceStage


@pytest.fixture
def make_stage() -> Iterator[Callable[..., tuple[DeviceStage, FakeBackend]]]:
    """`make_stage(**kwargs)`: a DeviceStage on a fresh FakeBackend, closed after the test."""
    stages: list[DeviceStage] = []

    def make(backend: FakeBackend | None = None, **kwargs: Any) -> tuple[DeviceStage, FakeBackend]:
        backend = backend or FakeBackend()
        stages.append(DeviceStage(backend, **kwargs))
        return stages[-1], backend

    yield make
    for stage in stages:
        stage.close()
