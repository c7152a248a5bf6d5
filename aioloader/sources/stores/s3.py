"""S3 and S3-compatible stores: keys are object keys under s3://bucket/prefix, listed with ListObjectsV2.

Requests are signed with botocore's SigV4 signer and sent over aiohttp. Throttling (429, or 503
SlowDown) shrinks the number of requests in flight for the whole source (AIMD, see `_tuning/aimd.py`) rather
than having every request retry at full concurrency; `stats()["concurrency_limit"]` shows the limit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from botocore.credentials import Credentials

from ..._exceptions import FetchError, InvalidKeyError
from ..._tuning.aimd import Aimd
from ..._tuning.ramp import Ramp
from ..._util.validate import check_int
from ..transport.client import Transport
from ..transport.redact import redact_url
from ..transport.remote import RemoteOptions
from .keyspace import PARTS
from .listing import Bucket, Listing, Page, PageAt
from .listobjects import list_query, parse_listing
from .manifest import Manifest
from .s3auth import AwsConfig, Signer, bucket_base, parse_s3_url

__all__ = ["S3", "s3"]


class S3(Bucket):
    """The objects under an S3 prefix, as a source. See `s3()` for the arguments.

    `keys()` lists every object now (sorted, blocking); `iter_keys()` streams the listing page by page
    on the running loop. `fetch(key)` returns the object's bytes in a `bytearray`; `fetch_range`
    part of it. Fetches are coroutines, safe to cancel, and raise `FetchError` naming the object and
    the S3 error code (e.g. "SignatureDoesNotMatch" for a wrong secret).

    Example:
        >>> src = s3("s3://my-bucket/train/", region="eu-west-1", credentials=("AKIA...", "..."))
        >>> src.url("train/0001.jpg")
        'https://my-bucket.s3.eu-west-1.amazonaws.com/train/0001.jpg'
    """

    list_width = PARTS  # pages in flight for one listing

    def __init__(
        self,
        url: str,
        keys: Sequence[str] | None = None,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        credentials: Credentials | Sequence[str] | None = None,
        profile: str | None = None,
        anonymous: bool = False,
        addressing: str = "auto",
        min_concurrency: int = 1,
        page_size: int = 1000,
        stream_keys: bool = False,
        manifest: str | os.PathLike[str] | Manifest | None = None,
        remote: RemoteOptions | None = None,
        **options: Any,
    ) -> None:
        """`options`: the arguments every remote source takes (`RemoteOptions`: concurrency,
        timeouts, retries, TLS, engine), one by one or together as `remote`."""
        shared = RemoteOptions.of(remote, options, "s3")
        concurrency = shared.concurrency
        check_int("page_size", page_size, minimum=1)
        self.bucket, self.prefix = parse_s3_url(url)
        self.listing = Listing(self, self.where, self.prefix, "s3", keys, stream_keys, manifest)
        config = AwsConfig(profile)
        self.signer = Signer(credentials, region=region, anonymous=anonymous, config=config)
        endpoint_from = "endpoint_url"
        if endpoint_url is None:
            endpoint_url, endpoint_from = config.endpoint_url()
        self.base = bucket_base(
            self.bucket, endpoint_url, self.signer.region, addressing, endpoint_from
        )
        self.page_size = min(page_size, 1000)
        self._options: dict[str, Any] = {
            **shared.transport_options(),
            "sign": self.signer,
            "redirects": False,
            "dns_hint": _endpoint_hint(endpoint_url, endpoint_from),
        }
        self.limiter = Aimd(
            concurrency, min(min_concurrency, concurrency), ramp=Ramp.for_job(concurrency)
        )
        self.transport = Transport(limit=concurrency, limiter=self.limiter, **self._options)

    def __repr__(self) -> str:
        return f"s3('s3://{self.bucket}/{self.prefix}', base={redact_url(self.base)!r})"

    def url(self, key: str) -> str:
        """The URL of object `key` (the full key within the bucket)."""
        if not isinstance(key, str) or not key or "\x00" in key:
            raise InvalidKeyError(f"key {key!r} is not an S3 object key")
        return self.base + quote(key, safe="/~")

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    async def list_page(self, transport: Transport, at: PageAt) -> Page:
        """One page of the listing (`Pages`)."""
        query = list_query(self.prefix, self.page_size, at.token, at.after)  # no end: S3 has none
        body = await transport.get(f"{self.base}?{query}", key=self.where)
        try:
            page = parse_listing(bytes(body))
        except ValueError as exc:  # ParseError is a SyntaxError; bad ints are ValueErrors
            where = self.where
            raise FetchError(f"bad ListObjectsV2 answer for {where}: {exc}", key=where) from None
        return Page(page.objects, page.etags, page.next_token)

    def list_transport(self) -> Transport:
        """A transport for listing on a thread of its own (`Pages`)."""
        return Transport(limit=PARTS, **self._options)

    def stats(self) -> dict[str, float]:
        """The adaptive concurrency limit, the request counters and the cache's (`cache_dir`)."""
        return {**super().stats(), **self.limiter.stats()}


def _endpoint_hint(endpoint_url: str | None, endpoint_from: str) -> str:
    """Where the endpoint came from, for the error a host that never resolves raises."""
    if endpoint_url is None:
        return (
            "no endpoint_url, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or profile endpoint_url is "
            "set, so this is AWS's endpoint"
        )
    return f"the endpoint is {redact_url(endpoint_url)!r}, from {endpoint_from}"


def s3(url: str, keys: Sequence[str] | None = None, **options: Any) -> S3:
    """A source of the objects under `url` ("s3://bucket/prefix") in S3 or an S3-compatible store.

    Args:
        url: "s3://bucket/prefix"; keys are full object keys starting with the prefix.
        keys: the keys to read, when known (a manifest); None lists the prefix.
        endpoint_url: e.g. "http://127.0.0.1:8333" for MinIO/SeaweedFS; None: AWS_ENDPOINT_URL_S3,
            AWS_ENDPOINT_URL, the profile's `endpoint_url` (see `AwsConfig`), else AWS.
        region: signing region; None: AWS_REGION, AWS_DEFAULT_REGION, the profile's, else
            "us-east-1".
        credentials: (access_key, secret_key[, session_token]) or a botocore Credentials; None uses
            botocore's standard chain (environment, ~/.aws files, profile, container/instance role).
        profile, anonymous: the profile to read (None: AWS_PROFILE, else "default"); unsigned
            requests for public buckets.
        addressing: "virtual" (bucket.host), "path" (host/bucket) or "auto" (virtual on AWS).
        concurrency, min_concurrency: the largest and smallest number of requests in flight.
        page_size: keys per ListObjectsV2 page (at most 1000).
        stream_keys: `keys()` streams the listing (an async iterable) instead of listing it all first.
        manifest: a `Manifest` or the file `python -m aioloader manifest URL -o FILE` wrote: its
            keys, sizes and ETags, read instead of listing (ValueError if it lists another prefix).
            Without one, ranks of a torch.distributed job list the prefix once for the whole job.
        connect_timeout, read_timeout, deadline, attempts, backoff, max_backoff, ssl, engine: as for
            `http()`.
    """
    return S3(url, keys, **options)
