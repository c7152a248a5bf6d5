"""Google Cloud Storage: keys are object names under gs://bucket/prefix, listed page by page.

With OAuth credentials (a service account, an authorized user, the metadata server, a token) or none,
objects are read through the JSON API (`/storage/v1/b/BUCKET/o/NAME?alt=media`, listings from
`/storage/v1/b/BUCKET/o`); with HMAC keys, through the XML API (`/BUCKET/NAME`, ListObjectsV2
listings), each request signed GOOG4-HMAC-SHA256. Where credentials come from: see `gcsauth.py`.
Requests go over the remote sources' `Transport`: retries with backoff, deadlines, the "fast" engine,
and AIMD concurrency that 429 and 503 answers (GCS's throttling) shrink for the whole source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from ..._exceptions import FetchError, InvalidKeyError
from ..._tuning.aimd import Aimd
from ..._tuning.ramp import Ramp
from ..._util.validate import check_int
from ..transport.client import Transport
from ..transport.redact import redact_url
from ..transport.remote import RemoteOptions
from . import listobjects
from .gcsauth import Bearer, Found, Tokens, find_credentials, parse_gs_url
from .keyspace import PARTS
from .listing import Bucket, Listing, Page, PageAt
from .listobjects import list_query, parse_listing
from .manifest import Manifest

__all__ = ["GCS", "gcs"]

ENDPOINT = "https://storage.googleapis.com"
_FIELDS = "items(name,size,etag),nextPageToken"


class GCS(Bucket):
    """The objects under a GCS prefix, as a source. See `gcs()` for the arguments.

    `keys()` lists every object now (sorted, blocking); `iter_keys()` streams the listing page by
    page on the running loop; `size(key)` is the size the listing gave. `fetch(key)` returns the
    object's bytes in a `bytearray`, `fetch_range` part of it; both raise `FetchError` naming the
    object, the status and the attempts.

    Example:
        >>> src = gcs("gs://my-bucket/train/", anonymous=True)
        >>> src.url("train/0001.jpg")
        'https://storage.googleapis.com/storage/v1/b/my-bucket/o/train%2F0001.jpg?alt=media'
    """

    list_width = PARTS  # pages in flight for one listing

    def __init__(
        self,
        url: str,
        keys: Sequence[str] | None = None,
        *,
        endpoint_url: str | None = None,
        credentials_file: str | os.PathLike[str] | None = None,
        token: str | None = None,
        hmac: Sequence[str] | None = None,
        anonymous: bool = False,
        min_concurrency: int = 1,
        page_size: int = 1000,
        stream_keys: bool = False,
        manifest: str | os.PathLike[str] | Manifest | None = None,
        remote: RemoteOptions | None = None,
        **options: Any,
    ) -> None:
        """`options`: the arguments every remote source takes (`RemoteOptions`: concurrency,
        timeouts, retries, TLS, engine), one by one or together as `remote`."""
        shared = RemoteOptions.of(remote, options, "gcs")
        check_int("page_size", page_size, minimum=1)
        self.bucket, self.prefix = parse_gs_url(url)
        self.listing = Listing(self, self.where, self.prefix, "gcs", keys, stream_keys, manifest)
        self.endpoint, emulator = _endpoint(endpoint_url)
        self.credentials: Found = find_credentials(
            token=token, credentials_file=credentials_file, hmac_key=hmac,
            anonymous=anonymous, emulator=emulator,
        )  # fmt: skip
        self.xml = self.credentials.hmac is not None
        self.page_size = min(page_size, 1000)
        self.tokens = None
        if self.credentials.oauth is not None:
            self.tokens = Tokens(self.credentials.oauth, shared.ssl)
        sign = self.credentials.hmac or (Bearer(self.tokens) if self.tokens else None)
        self._options: dict[str, Any] = {**shared.transport_options(), "sign": sign,
                                         "redirects": False}  # fmt: skip
        self.limiter = Aimd(
            shared.concurrency, min(min_concurrency, shared.concurrency),
            ramp=Ramp.for_job(shared.concurrency),
        )  # fmt: skip
        self.transport = self._transport(shared.concurrency, self.limiter)

    def _transport(self, limit: int, limiter: Aimd | None = None) -> Transport:
        return Transport(limit=limit, limiter=limiter, **self._options)  # `Bearer` prepares

    def __repr__(self) -> str:
        return (
            f"gcs('gs://{self.bucket}/{self.prefix}', endpoint={redact_url(self.endpoint)!r}, "
            f"credentials={self.credentials.describe()!r})"
        )

    def url(self, key: str) -> str:
        """The URL of object `key` (its full name in the bucket)."""
        if not isinstance(key, str) or not key or "\x00" in key or "\n" in key or "\r" in key:
            raise InvalidKeyError(f"key {key!r} is not a GCS object name")
        if self.xml:
            return f"{self.endpoint}/{quote(self.bucket, safe='')}/{quote(key, safe='/~')}"
        return f"{self._json_base()}/{quote(key, safe='')}?alt=media"

    def _json_base(self) -> str:
        return f"{self.endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o"

    def _list_url(self, at: PageAt) -> str:
        """A listing page's URL: the XML API's start-after, or the JSON API's startOffset (the
        names from it on) and endOffset (those before it: any name after `until` will do, since
        the part checks its bounds itself; `until` and a space keeps the query printable)."""
        if self.xml:
            query = list_query(self.prefix, self.page_size, at.token, at.after)
            return f"{self.endpoint}/{quote(self.bucket, safe='')}?{query}"
        params = [("fields", _FIELDS), ("maxResults", str(self.page_size)), ("prefix", self.prefix)]
        if at.token:
            params.append(("pageToken", at.token))
        if at.after is not None:
            params.append(("startOffset", at.after))
        if at.until is not None:
            params.append(("endOffset", at.until + " "))
        return self._json_base() + "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in params)

    @property
    def where(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}"

    async def list_page(self, transport: Transport, at: PageAt) -> Page:
        """One page of the listing (`Pages`)."""
        body = await transport.get(self._list_url(at), key=self.where)
        try:
            page = parse_listing(bytes(body)) if self.xml else parse_json_listing(bytes(body))
        except (ValueError, KeyError, TypeError, SyntaxError) as exc:
            where = self.where
            raise FetchError(f"bad listing answer for {where}: {exc!r}", key=where) from None
        return Page(page.objects, page.etags, page.next_token)

    def list_transport(self) -> Transport:
        """A transport for listing on a thread of its own (`Pages`)."""
        return self._transport(PARTS)

    def stats(self) -> dict[str, float]:
        """The adaptive concurrency limit, the request counters, the cache's (`cache_dir`) and the
        OAuth token refreshes."""
        refreshes = {"token_refreshes": self.tokens.refreshes} if self.tokens else {}
        return {**super().stats(), **self.limiter.stats(), **refreshes}


def parse_json_listing(body: bytes) -> listobjects.Listing:
    """One page of a JSON API object listing: (name, size) pairs and the next page's token."""
    answer = json.loads(body)
    items = answer.get("items", [])
    objects = [(str(item["name"]), int(item["size"])) for item in items]
    etags = {str(item["name"]): str(item["etag"]) for item in items if item.get("etag")}
    return listobjects.Listing(objects, answer.get("nextPageToken") or None, etags)


def _endpoint(endpoint_url: str | None) -> tuple[str, bool]:
    """(the endpoint, whether it is an emulator's from STORAGE_EMULATOR_HOST), without a final /."""
    name, emulator = "endpoint_url", False
    if endpoint_url is None and (host := os.environ.get("STORAGE_EMULATOR_HOST")):
        name, emulator = "STORAGE_EMULATOR_HOST", True
        endpoint_url = host if "://" in host else f"http://{host}"
    endpoint = (endpoint_url or ENDPOINT).rstrip("/")
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except (ValueError, TypeError):
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} must be an http(s) URL, got {redact_url(endpoint_url)!r}")
    if port == {"http": 80, "https": 443}[parts.scheme]:  # as both engines send Host
        endpoint = endpoint.replace(f":{port}", "", 1)
    return endpoint, emulator


def gcs(url: str, keys: Sequence[str] | None = None, **options: Any) -> GCS:
    """A source of the objects under `url` ("gs://bucket/prefix") in Google Cloud Storage.

    Args:
        url: "gs://bucket/prefix"; keys are full object names starting with the prefix.
        keys: the keys to read, when known (a manifest); None lists the prefix.
        endpoint_url: e.g. "http://127.0.0.1:4443" for an emulator; None: STORAGE_EMULATOR_HOST
            (then anonymous unless credentials are given), else Google's endpoint.
        credentials_file: a service-account key or authorized-user JSON file; None: the
            application-default chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud's file, the
            Compute Engine metadata server). Service-account keys need `aioloader[gcs]`.
        token: an OAuth access token, used as it is (never refreshed).
        hmac: (access_id, secret) of an HMAC key: requests go to the XML API, signed.
        anonymous: unauthenticated requests (public buckets, emulators).
        concurrency, min_concurrency: the largest and smallest number of requests in flight.
        page_size: objects per listing page (at most 1000).
        stream_keys: `keys()` streams the listing (an async iterable) instead of listing it all first.
        manifest: a `Manifest` or the file `python -m aioloader manifest URL -o FILE` wrote: its
            keys, sizes and ETags, read instead of listing (ValueError if it lists another prefix).
            Without one, ranks of a torch.distributed job list the prefix once for the whole job.
        connect_timeout, read_timeout, deadline, attempts, backoff, max_backoff, ssl, engine: as for
            `http()`.
    """
    return GCS(url, keys, **options)
