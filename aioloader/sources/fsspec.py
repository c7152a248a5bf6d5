"""Any filesystem fsspec knows, as a source (written in `stores/fsspec.py`)."""

from .stores.fsspec import Fsspec as Fsspec
from .stores.fsspec import fsspec as fsspec

__all__ = ["Fsspec", "fsspec"]
