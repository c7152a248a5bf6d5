"""Fixtures for the remote-source tests (HTTP, S3, tar shards); tests/conftest.py star-imports them.

- `objects`: 48 objects of a few KiB each, named "obj/00000.bin" ..., with distinct contents.
- `origin`: an `Origin` serving `objects` on 127.0.0.1; `proxy`: a `FaultProxy` in front of it.
- `seaweed`: one SeaweedFS server (S3 API) per test session; see support/s3server.py.
- `gcs_server`: one fake-gcs-server per test session; see support/gcsserver.py.
- `azurite`: one Azurite (Azure Blob's emulator) per test session; see support/azurite.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from support.azurite import azurite
from support.faultproxy import FaultProxy, Origin
from support.gcsserver import gcs_server
from support.s3server import SeaweedServer, start_seaweed

__all__ = ["azurite", "gcs_server", "objects", "origin", "proxy", "seaweed"]

N_OBJECTS = 48


@pytest.fixture
def objects() -> dict[str, bytes]:
    """Distinct objects of 1-9 KiB, keyed by name."""
    rng = random.Random(7)
    return {f"obj/{i:05d}.bin": rng.randbytes(1024 * (1 + i % 9)) for i in range(N_OBJECTS)}


@pytest.fixture
def origin(objects: dict[str, bytes]) -> Iterator[Origin]:
    """An object server on 127.0.0.1 holding `objects`."""
    server = Origin(objects)
    yield server
    server.stop()


@pytest.fixture
def proxy(origin: Origin) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of `origin` (forwards everything until given a plan)."""
    server = FaultProxy(origin.url)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A SeaweedFS S3 endpoint for the session (fails, not skips, when `weed` cannot start)."""
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()
