"""Torch datasets for the DataLoader tests: map-style (`MapDataset`, with `__getitems__`, async),
iterable (`Stream`), the samples they hold (`sample`); `both`: two epochs of torch's DataLoader and
of ours with the same arguments; `outcomes`: what each `next()` of an epoch gave or raised."""

from __future__ import annotations

import asyncio
from collections import namedtuple
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset

from aioloader import DataLoader

Point = namedtuple("Point", ["x", "label"])


def sample(i: int, kind: str) -> Any:
    x = torch.arange(4, dtype=torch.float32) + i
    if kind == "tensor":
        return x
    if kind == "dict":
        return {"x": x, "label": i, "name": f"s{i}", "w": float(i) / 2}
    if kind == "tuple":
        return (x.numpy().copy(), i, np.float32(i))
    if kind == "namedtuple":
        return Point(x, i)
    if kind == "nested":
        return {"pair": (x, [i, i + 1]), "meta": {"id": f"k{i}", "raw": b"r"}}
    raise AssertionError(kind)


class MapDataset(Dataset[Any]):
    def __init__(self, n: int = 23, kind: str = "dict") -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return sample(int(i), self.kind)


class GetItemsDataset(MapDataset):
    def __init__(self) -> None:
        super().__init__(kind="dict")
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class AsyncDataset(MapDataset):
    async def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        await asyncio.sleep(0.001 * (i % 3))
        return sample(int(i), self.kind)


class Stream(IterableDataset[Any]):
    def __init__(self, n: int = 17) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return (sample(i, "tuple") for i in range(self.n))

    def __len__(self) -> int:
        return self.n


def both(dataset: Any, make: Any = None, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """Two epochs of each loader, each with its own arguments from `make()` (fresh samplers and
    generators, so that both start from the same random state)."""
    expected = TorchDataLoader(dataset, **(make() if make else kwargs))
    with DataLoader(dataset, **(make() if make else kwargs)) as ours:
        got = [list(ours), list(ours)]
        assert len(ours) == len(expected)
    return [list(expected), list(expected)], got


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def outcomes(loader: Any) -> list[Any]:
    """Each `next()` of one epoch: the batch as a list, or the type and message it raised."""
    got: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return got
        except Exception as exc:
            got.append((type(exc).__name__, str(exc).splitlines()[-1]))
            continue
        got.append(batch.tolist())
