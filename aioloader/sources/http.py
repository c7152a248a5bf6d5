"""Objects served over HTTP(S), as a source (written in `stores/http.py`)."""

from .stores.http import Http as Http
from .stores.http import http as http

__all__ = ["Http", "http"]
