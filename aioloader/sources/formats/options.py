"""What the sources over files of samples share (tar shards, Parquet files): their order, this reader's
share of the files, and the options of the stores the files are read from.

`tar_shards()` and `parquet()` take these as keyword arguments, named as the fields of `ShardOptions`,
and hand them to their source as one `ShardOptions`; `TarShards(...)` and `Parquet(...)` take them
one by one too, or together as `options=`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._util.validate import check_int

__all__ = ["ShardOptions"]


@dataclass(frozen=True)
class ShardOptions:
    """The arguments `tar_shards()` and `parquet()` share; see either for what each one does."""

    shuffle: bool = True
    shuffle_buffer: int = 0
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1
    http_options: dict[str, Any] | None = None
    s3_options: dict[str, Any] | None = None
    gcs_options: dict[str, Any] | None = None
    azure_options: dict[str, Any] | None = None

    @classmethod
    def of(
        cls, options: ShardOptions | None, given: Mapping[str, Any], source: str
    ) -> ShardOptions:
        """`options` (None: the defaults) with `given`, keyword arguments named as its fields, in
        their place: how a source's constructor takes these, one by one or as one object."""
        unknown = sorted(given.keys() - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{source}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options or cls(), **given)

    def check(self, items: str) -> None:
        """Raise the error the first wrong argument deserves; `items` names what a shuffle buffer
        mixes ("samples", "rows")."""
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {self.shuffle!r}")
        for name, value, low in (("world_size", self.world_size, 1),
                                 ("num_workers", self.num_workers, 1), ("rank", self.rank, 0),
                                 ("worker", self.worker, 0), ("seed", self.seed, 0),
                                 ("shuffle_buffer", self.shuffle_buffer, 0)):  # fmt: skip
            check_int(name, value, minimum=low)
        if not self.shuffle and self.shuffle_buffer:
            raise ValueError(
                f"shuffle_buffer={self.shuffle_buffer} mixes {items}, but shuffle=False asks for "
                "the stored order: drop one of them"
            )
        if self.rank >= self.world_size or self.worker >= self.num_workers:
            raise ValueError(
                f"need rank < world_size and worker < num_workers, got {self.rank}, {self.worker}"
            )

    def place(self, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
        """(slot, slots): this reader's place among the `world_size * num_workers` readers, at
        `rank` of `world_size` (default: the ones given here)."""
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        return rank * self.num_workers + self.worker, world_size * self.num_workers

    def stores(self) -> dict[str, dict[str, Any]]:
        """Each store's options by the kind a URL scheme names ("http", "s3", "gcs", "az"), copied:
        what the sources made for the files of those schemes are given."""
        return {
            "http": dict(self.http_options or {}),
            "s3": dict(self.s3_options or {}),
            "gcs": dict(self.gcs_options or {}),
            "az": dict(self.azure_options or {}),
        }
