"""Local files, as a source (written in `stores/files.py`)."""

from .stores.files import Files as Files
from .stores.files import files as files

__all__ = ["Files", "files"]
