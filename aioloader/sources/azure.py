"""Azure Blob Storage, as a source (written in `stores/azure.py`)."""

from .stores.azure import Azure as Azure
from .stores.azure import azure as azure

__all__ = ["Azure", "azure"]
