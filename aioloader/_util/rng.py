"""Per-sample randomness: a seed derived from (seed, epoch, position), the same in every executor.

The pipeline derives each sample's seed with `derive_seed(seed, epoch, position)` and hands it to the
executor with the decode call; the executor runs the call through `call_seeded`, which makes that
seed current for the call. A decode callable that augments at random draws from
`sample_generator()` (torch) or `sample_np_generator()` (numpy) and so depends only on the loader's
seed, the epoch and the key's position — never on which thread or process ran it, or when.

Inline and thread executors call `call_seeded` in the parent; the process executor sends the seed
with the task and its worker calls `call_seeded` around the decode call.

Example:
    >>> seed = derive_seed(0, epoch=1, position=7)
    >>> a = call_seeded(lambda _: torch.rand(2, generator=sample_generator()), None, seed)
    >>> b = call_seeded(lambda _: torch.rand(2, generator=sample_generator()), None, seed)
    >>> bool((a == b).all())
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import numpy as np
import numpy.random  # loaded with the package, not by a first shuffle (~20 ms)
import torch

__all__ = [
    "call_seeded",
    "derive_seed",
    "sample_generator",
    "sample_np_generator",
    "sample_seed",
]

T = TypeVar("T")


def derive_seed(seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for one sample: a hash of (seed, epoch, position)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class _Current:
    """The seed of the running decode call, and the generators made from it (one of each per call).
    Given as (seed, epoch, position), the seed is derived when it is first asked for."""

    __slots__ = ("_seed", "numpy", "torch")

    def __init__(self, seed: int | tuple[int, int, int]) -> None:
        self._seed = seed
        self.torch: torch.Generator | None = None
        self.numpy: np.random.Generator | None = None

    @property
    def seed(self) -> int:
        if isinstance(self._seed, tuple):
            self._seed = derive_seed(*self._seed)
        return self._seed


_current: ContextVar[_Current | None] = ContextVar("aioloader_sample_seed", default=None)


def call_seeded(fn: Callable[[Any], T], arg: Any, seed: int | tuple[int, int, int] | None) -> T:
    """Call `fn(arg)` with `seed` as the current sample's seed (None: no seed for this call; a
    tuple: `derive_seed`'s (seed, epoch, position), derived only if the call asks for it).

    The seed is set in the calling context only (thread, task or worker process) and reset after the
    call, whatever it raises.
    """
    token = _current.set(None if seed is None else _Current(seed))
    try:
        return fn(arg)
    finally:
        _current.reset(token)


def _require(name: str) -> _Current:
    current = _current.get()
    if current is None:
        raise RuntimeError(
            f"aioloader.{name}() works only inside a loader's decode callable, where the sample's "
            "seed (from the loader's seed, the epoch and the key's position) is known"
        )
    return current


def sample_seed() -> int:
    """The current sample's seed (63 bits).

    Raises:
        RuntimeError: outside a decode call run by a loader's executor.
    """
    return _require("sample_seed").seed


def sample_generator() -> torch.Generator:
    """A torch generator seeded with `sample_seed()`; the same object for the whole decode call.

    Raises:
        RuntimeError: outside a decode call run by a loader's executor.
    """
    current = _require("sample_generator")
    if current.torch is None:
        current.torch = torch.Generator().manual_seed(current.seed)
    return current.torch


def sample_np_generator() -> np.random.Generator:
    """A numpy generator (PCG64) seeded with `sample_seed()`; one per decode call.

    Raises:
        RuntimeError: outside a decode call run by a loader's executor.
    """
    current = _require("sample_np_generator")
    if current.numpy is None:
        current.numpy = np.random.default_rng(current.seed)
    return current.numpy
