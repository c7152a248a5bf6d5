"""Where bytes come from: each source lists keys and fetches one key's raw sample."""

from .._protocol import Source as Source
from .azure import Azure as Azure
from .azure import azure as azure
from .files import Files as Files
from .files import files as files
from .fsspec import Fsspec as Fsspec
from .fsspec import fsspec as fsspec
from .gcs import GCS as GCS
from .gcs import gcs as gcs
from .http import Http as Http
from .http import http as http
from .parquet import Parquet as Parquet
from .parquet import ParquetError as ParquetError
from .parquet import parquet as parquet
from .s3 import S3 as S3
from .s3 import s3 as s3
from .stores.manifest import Manifest as Manifest
from .tar import SampleRef as SampleRef
from .tar import TarShards as TarShards
from .tar import tar_shards as tar_shards
from .transport.remote import RemoteOptions as RemoteOptions

__all__ = [
    "GCS",
    "S3",
    "Azure",
    "Files",
    "Fsspec",
    "Http",
    "Manifest",
    "Parquet",
    "ParquetError",
    "RemoteOptions",
    "SampleRef",
    "Source",
    "TarShards",
    "azure",
    "files",
    "fsspec",
    "gcs",
    "http",
    "parquet",
    "s3",
    "tar_shards",
]
