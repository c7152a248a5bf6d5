"""S3 and the stores that speak its API, as a source (written in `stores/s3.py`)."""

from .stores.s3 import S3 as S3
from .stores.s3 import s3 as s3

__all__ = ["S3", "s3"]
