"""The user's code of `peers_rs.py`, written once as a torch user writes it: module-level Dataset
classes that every contender's interpreter imports. Only numpy, the standard library and, where the
interpreter has it, torch (the dataloader-rs venv has no torch: dataloader-rs does not need it, and
there the classes derive from `object`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

try:
    from torch.utils.data import Dataset
except ImportError:  # .venv-rs: no torch
    Dataset = object  # type: ignore[assignment,misc]

SEED_WAIT_S = 0.003125  # dropin.py (a)'s read
SEED_SHAPE = (1000, 150)
IO_WAIT_S = 0.020  # a request to an object store
IO_BYTES = 4096
PY_LOOP = 4500  # iterations of Python arithmetic: about 0.4 ms on this machine's CPython 3.11


class Ints(Dataset):  # type: ignore[type-arg]
    """Each item is its index: the loader's own cost per sample."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> int:
        return index


class SleepyArrays(Dataset):  # type: ignore[type-arg]
    """dropin.py (a): each item blocks on a read, then returns a fresh 1000x150 float64 array."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(SEED_WAIT_S)
        return np.random.random(SEED_SHAPE)


class RemoteBlobs(Dataset):  # type: ignore[type-arg]
    """I/O-bound: each item waits 20 ms for a 4 KiB object, then views its bytes as an array."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(IO_WAIT_S)
        payload = index.to_bytes(8, "little") * (IO_BYTES // 8)
        return np.frombuffer(payload, dtype=np.uint8).copy()


class PythonWork(Dataset):  # type: ignore[type-arg]
    """GIL-holding: each item is a pure-Python arithmetic loop (about 0.4 ms)."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> int:
        acc = index
        for i in range(PY_LOOP):
            acc = (acc * 31 + i) % 1_000_003
        return acc


DATASETS: dict[str, Any] = {
    "int": Ints,
    "seed": SleepyArrays,
    "io": RemoteBlobs,
    "gil": PythonWork,
}
