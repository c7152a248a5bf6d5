"""`aioloader.DataLoader(num_workers=N)`: the dataset read in N worker processes, as torch does.

The callables here are sent once to each worker of a `ProcessExecutor` (they pickle the dataset).
Inside a worker, `torch.utils.data.get_worker_info()` answers as it does in torch's workers (id,
num_workers, seed, dataset), so sharding code written for torch's DataLoader keeps working; the
worker's torch and `random` generators are seeded from the loader's base seed plus the worker id.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils import worker as torch_worker

__all__ = ["ReadBatch", "ReadItem", "WorkerSetup"]

_worker: dict[str, int] = {}  # in a worker process: its id, the number of workers, its seed


class WorkerSetup:
    """`worker_init_fn` of the process pool: seeds the worker, then calls the user's hook."""

    def __init__(
        self, num_workers: int, base_seed: int, user_fn: Callable[[int], Any] | None
    ) -> None:
        self.num_workers, self.base_seed, self.user_fn = num_workers, base_seed, user_fn

    def __call__(self, worker_id: int) -> None:
        seed = (self.base_seed + worker_id) % 2**63
        _worker.update(id=worker_id, num_workers=self.num_workers, seed=seed)
        torch.manual_seed(seed)
        random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _publish(dataset: Any) -> None:
    """Make `get_worker_info()` describe this worker, with the dataset the reads run on."""
    if _worker and torch_worker._worker_info is None:
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=_worker["id"], num_workers=_worker["num_workers"], seed=_worker["seed"],
            dataset=dataset,
        )  # fmt: skip


class ReadItem:
    """index -> `dataset[index]` (then `convert`, torch's per-sample collate_fn without batching)."""

    def __init__(self, dataset: Any, convert: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.convert = dataset, convert

    def __call__(self, index: Any) -> Any:
        _publish(self.dataset)
        item = self.dataset[index]
        return item if self.convert is None else self.convert(item)


class ReadBatch:
    """indices -> `collate(dataset.__getitems__(indices))`, one call per batch as torch makes it."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, indices: list[Any]) -> Any:
        _publish(self.dataset)
        return self.collate(self.dataset.__getitems__(indices))
