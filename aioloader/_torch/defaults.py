"""What torch's DataLoader derives from its arguments: its samplers and the collate it shows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_convert,
)

from .._pipeline.collate import DEFAULT_COLLATE, default_collate

__all__ = ["collates", "samplers"]


def samplers(
    dataset: Any,
    iterable: bool,
    shuffle: bool | None,
    sampler: Sampler[Any] | Iterable[Any] | None,
    batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None,
    batch_size: int | None,
    drop_last: bool,
    generator: torch.Generator | None,
) -> tuple[Sampler[Any] | Iterable[Any] | None, Sampler[list[Any]] | Iterable[list[Any]] | None]:
    """(sampler, batch_sampler) as torch's DataLoader makes them from its arguments."""
    if sampler is None and not iterable:
        sampler = (
            RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        )
    if batch_size is not None and batch_sampler is None and not iterable:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)  # type: ignore[arg-type]
    return sampler, batch_sampler


def collates(
    collate_fn: Callable[[list[Any]], Any] | None, auto_collation: bool
) -> tuple[Callable[[Any], Any], Any]:
    """(the `collate_fn` attribute torch shows, the collate the loader runs)."""
    if collate_fn is None and auto_collation:
        return default_collate, DEFAULT_COLLATE
    collate_fn = collate_fn or default_convert
    return collate_fn, collate_fn
