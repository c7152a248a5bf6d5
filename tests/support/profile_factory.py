"""A tiny loader factory for the `python -m aioloader profile` tests (not a test module)."""

from __future__ import annotations

import asyncio
from typing import Any

from aioloader import Loader


async def fetch(key: int) -> bytes:
    await asyncio.sleep(0.002)
    return bytes(256)


def make() -> Loader[Any]:
    """A fetch-bound loader: 2 ms per fetch, 2 at a time, 40 samples in batches of 4."""
    return Loader(range(40), fetch, batch_size=4, collate=None, concurrency=2)


def not_a_loader() -> list[int]:
    return [1, 2, 3]
