"""The ListObjectsV2 listing: the query of one page and its answer parsed, as S3 speaks it.

GCS's XML API answers the same request in the same form, so `gcs.py` lists with these too (its JSON
API has a parser of its own there).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from urllib.parse import quote

__all__ = ["Listing", "list_query", "parse_listing"]


def list_query(
    prefix: str, page_size: int, token: str | None, start_after: str | None = None
) -> str:
    """The query of one ListObjectsV2 request, encoded as SigV4 expects (`start_after`: the
    listing's first page starts after that key; a continuation token carries it on)."""
    params = [("list-type", "2"), ("max-keys", str(page_size)), ("prefix", prefix)]
    if token is not None:
        params.append(("continuation-token", token))
    elif start_after is not None:
        params.append(("start-after", start_after))
    return "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params))


@dataclass
class Listing:
    """One page of a listing: (key, size) pairs, the token of the next page (None: last page), and
    the ETag of each key that has one."""

    objects: list[tuple[str, int]]
    next_token: str | None
    etags: dict[str, str] = field(default_factory=dict)


def parse_listing(body: bytes) -> Listing:
    """Parse a ListObjectsV2 response (namespaced or not)."""
    root = ET.fromstring(body)
    objects, truncated, token = [], False, None
    etags: dict[str, str] = {}
    for child in root:
        tag = child.tag.rpartition("}")[2]
        if tag == "Contents":
            fields = {c.tag.rpartition("}")[2]: c.text or "" for c in child}
            objects.append((fields.get("Key", ""), int(fields.get("Size") or 0)))
            if fields.get("ETag"):
                etags[fields.get("Key", "")] = fields["ETag"]
        elif tag == "IsTruncated":
            truncated = (child.text or "").strip().lower() == "true"
        elif tag == "NextContinuationToken":
            token = child.text
    return Listing(objects, token if truncated else None, etags)
