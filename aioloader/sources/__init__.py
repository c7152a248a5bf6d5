"""Where bytes come from: each source lists keys and fetches one key's raw sample."""

from ._base import Source as Source
from .files import Files as Files
from .files import files as files

__all__ = ["Files", "Source", "files"]
