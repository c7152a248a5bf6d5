"""Per-sample randomness that does not depend on timing, threads or processes.

Each decode call runs with a seed derived from (seed, epoch, key position); `sample_generator()` and
`sample_seed()` read it. So a random augmentation gives the same result for the same sample in the
same epoch whatever the executor, the number of workers, the concurrency, or a resume in between.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["call_seeded", "derive_seed", "sample_generator", "sample_seed"]

T = TypeVar("T")

_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "aioloader_seed", default=None
)


def derive_seed(seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for one sample: a hash of (seed, epoch, position)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def call_seeded(fn: Callable[[Any], T], arg: Any, seed: int | None) -> T:
    """Call `fn(arg)` with `seed` as the current sample's seed (in this thread or process)."""
    token = _current.set(seed)
    try:
        return fn(arg)
    finally:
        _current.reset(token)


def sample_seed() -> int:
    """The current sample's seed; raises RuntimeError outside a decode call."""
    seed = _current.get()
    if seed is None:
        raise RuntimeError("sample_seed() is only available inside a loader's decode call")
    return seed


def sample_generator() -> torch.Generator:
    """A torch.Generator seeded for the current sample (a new one per call, same seed)."""
    gen = torch.Generator()
    gen.manual_seed(sample_seed())
    return gen
