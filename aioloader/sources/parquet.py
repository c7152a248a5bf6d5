"""Parquet files, as a source (written in `formats/parquet.py`)."""

from .formats.parquet import Parquet as Parquet
from .formats.parquet import ParquetError as ParquetError
from .formats.parquet import RowRef as RowRef
from .formats.parquet import RowsRef as RowsRef
from .formats.parquet import parquet as parquet

__all__ = ["Parquet", "ParquetError", "RowRef", "RowsRef", "parquet"]
