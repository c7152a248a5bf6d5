"""WebDataset tar shards, as a source (written in `formats/tar.py`)."""

from .formats.tar import SampleRef as SampleRef
from .formats.tar import TarShards as TarShards
from .formats.tar import count_samples as count_samples
from .formats.tar import tar_shards as tar_shards

__all__ = ["SampleRef", "TarShards", "count_samples", "tar_shards"]
