"""Google Cloud Storage, as a source (written in `stores/gcs.py`)."""

from .stores.gcs import GCS as GCS
from .stores.gcs import gcs as gcs

__all__ = ["GCS", "gcs"]
