"""What the tests of `aioloader.mix` share: small inputs of every kind (a map-style dataset, streams,
a source with slow fetches), a mix of three, and ways to read a loader's or a mix's first items."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aioloader import Loader, Mix, MixKey, mix
from support.fakes import Boom


class Squares:
    """A map-style dataset (no keys of its own): item i is (name, i * i)."""

    def __init__(self, name: str, n: int, bad: int | None = None) -> None:
        self.name, self.n, self.bad = name, n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[str, int]:
        if i == self.bad:
            raise Boom(f"no item {i}")
        return self.name, i * i


class Stream:
    """An iterable of samples that starts again each time it is iterated (an IterableDataset)."""

    def __init__(self, name: str, n: int, fail_at: int | None = None) -> None:
        self.name, self.n, self.fail_at = name, n, fail_at

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for i in range(self.n):
            if i == self.fail_at:
                raise Boom(f"stream broke at {i}")
            yield self.name, i


class SlowStream:
    """An async iterable of samples, each after a random delay (its own RNG: the timing varies)."""

    def __init__(self, name: str, n: int, max_delay: float = 0.002) -> None:
        self.name, self.n, self.max_delay = name, n, max_delay

    async def __aiter__(self) -> AsyncIterator[tuple[str, int]]:
        for i in range(self.n):
            await asyncio.sleep(random.random() * self.max_delay)
            yield self.name, i


class SlowSource:
    """A Source with a length whose fetch takes a random time."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n = name, n

    def keys(self) -> list[int]:
        return list(range(self.n))

    async def fetch(self, key: int) -> tuple[str, int]:
        await asyncio.sleep(random.random() * 0.003)
        return self.name, key

    async def aclose(self) -> None:
        pass


def label(sample: Any) -> str:
    """A module-level decode (pickles to worker processes): the sample as text."""
    return f"{sample[0]}:{sample[1]}"


def three(stop: str = "all_exhausted", seed: int = 5) -> Mix:
    """A map-style dataset, a list and a re-iterable stream, mixed."""
    return mix(
        {"sq": Squares("sq", 40), "list": [("list", i) for i in range(25)], "st": Stream("st", 15)},
        {"sq": 3, "list": 2, "st": 1}, seed=seed, stop=stop,
    )  # fmt: skip


def batches(loader: Loader[Any], n: int | None = None) -> list[Any]:
    """The first `n` batches of the loader's next epoch (all of them when None)."""
    out: list[Any] = []
    if n == 0:
        return out
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


def stream_keys(m: Mix, epoch: int, n: int | None = None) -> list[MixKey]:
    """The first `n` keys of `epoch` (all of them when None), straight from the mix's stream."""

    async def run() -> list[MixKey]:
        out: list[MixKey] = []
        stream = m.stream(epoch)
        try:
            async for key in stream:
                out.append(key)
                if len(out) == n:
                    break
        finally:
            await stream.aclose()
            await m.aclose()
        return out

    return asyncio.run(run())


def text(sample: Any) -> Any:
    return sample["txt"].decode() if isinstance(sample, dict) else sample


def assert_resume_continues(make: Callable[[], Loader[Any]], whole: list[Any], cut: int) -> None:
    """A loader stopped after `cut` batches and one resumed from its state give `whole`."""
    with make() as b:
        head = batches(b, cut)
        state = b.state_dict()
    with make() as c:
        c.load_state_dict(state)
        assert head + batches(c) == whole
