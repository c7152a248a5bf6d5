"""S3 and S3-compatible stores: keys are object keys under s3://bucket/prefix, listed with ListObjectsV2.

Requests are signed with botocore's SigV4 signer and sent over aiohttp. Throttling (429, or 503
SlowDown) shrinks the number of requests in flight for the whole source (AIMD, see `_tuning/aimd.py`) rather
than having every request retry at full concurrency; `stats()["concurrency_limit"]` shows the limit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote

from botocore.credentials import Credentials

from .._exceptions import FetchError, InvalidKeyError
from .._tuning.aimd import Aimd
from .._util.validate import check_int
from ._redact import redact_url
from ._remote import Remote, RemoteOptions
from ._s3auth import AwsConfig, Signer, bucket_base, list_query, parse_listing, parse_s3_url
from ._transport import Transport

__all__ = ["S3", "s3"]


class S3(Remote):
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
        remote: RemoteOptions | None = None,
        **options: Any,
    ) -> None:
        """`options`: the arguments every remote source takes (`RemoteOptions`: concurrency,
        timeouts, retries, TLS, engine), one by one or together as `remote`."""
        shared = RemoteOptions.of(remote, options, "s3")
        concurrency = shared.concurrency
        check_int("page_size", page_size, minimum=1)
        self.bucket, self.prefix = parse_s3_url(url)
        self._given = None if keys is None else list(keys)
        self._sizes: dict[str, int] = {}  # from the listings (`size`)
        self._etags: dict[str, str] = {}  # from the listings (`etag`): a cached copy is checked
        config = AwsConfig(profile)
        self.signer = Signer(credentials, region=region, anonymous=anonymous, config=config)
        endpoint_from = "endpoint_url"
        if endpoint_url is None:
            endpoint_url, endpoint_from = config.endpoint_url()
        self.base = bucket_base(
            self.bucket, endpoint_url, self.signer.region, addressing, endpoint_from
        )
        self.page_size = min(page_size, 1000)
        self.stream_keys = stream_keys
        self._options: dict[str, Any] = {
            **shared.transport_options(),
            "sign": self.signer,
            "redirects": False,
            "dns_hint": _endpoint_hint(endpoint_url, endpoint_from),
        }
        self.limiter = Aimd(concurrency, min(min_concurrency, concurrency))
        self.transport = Transport(limit=concurrency, limiter=self.limiter, **self._options)

    def __repr__(self) -> str:
        return f"s3('s3://{self.bucket}/{self.prefix}', base={redact_url(self.base)!r})"

    def url(self, key: str) -> str:
        """The URL of object `key` (the full key within the bucket)."""
        if not isinstance(key, str) or not key or "\x00" in key:
            raise InvalidKeyError(f"key {key!r} is not an S3 object key")
        return self.base + quote(key, safe="/~")

    def iter_objects(self) -> AsyncIterator[tuple[str, int]]:
        """(key, size) of each object under the prefix, in key order, one page at a time."""
        return self._objects(self.transport)

    async def _objects(self, transport: Transport) -> AsyncIterator[tuple[str, int]]:
        token: str | None = None
        last = ""
        while True:
            query = list_query(self.prefix, self.page_size, token)
            where = f"s3://{self.bucket}/{self.prefix}"
            body = await transport.get(f"{self.base}?{query}", key=where)
            try:
                page = parse_listing(bytes(body))
            except ValueError as exc:  # ParseError is a SyntaxError; bad ints are ValueErrors
                raise FetchError(
                    f"bad ListObjectsV2 answer for {where}: {exc}", key=where
                ) from None
            self._etags.update(page.etags)
            for key, size in sorted(page.objects, key=lambda o: o[0].encode()):
                if key.endswith("/") and size == 0:
                    continue  # a "folder" marker
                if key.encode() <= last.encode():
                    raise FetchError(f"listing of {where} out of key order at {key!r}", key=where)
                last = key
                yield key, size
            if page.next_token is None:
                return
            token = page.next_token

    async def iter_keys(self) -> AsyncIterator[str]:
        """The keys under the prefix, in key order, streamed page by page (on the running loop)."""
        if self._given is not None:
            for key in self._given:
                yield key
            return
        async for key, size in self.iter_objects():
            self._sizes[key] = size
            yield key

    def keys(self) -> list[str] | AsyncIterable[str]:
        """Every key under the prefix, sorted (or the keys given). Blocks while it lists.

        With `stream_keys=True`: an async iterable that lists anew, page by page, each time it is
        iterated (the loader then starts fetching while the listing goes on; no shuffle, no length).
        """
        if self._given is not None:
            return list(self._given)
        if self.stream_keys:
            return _Listing(self)
        found: list[str] = []
        errors: list[BaseException] = []

        async def collect() -> None:
            transport = Transport(limit=4, **self._options)
            try:
                async for key, size in self._objects(transport):
                    self._sizes[key] = size
                    found.append(key)
            finally:
                await transport.aclose()

        def run() -> None:
            try:
                asyncio.run(collect())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, name="aioloader-s3-list")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return found

    def size(self, key: str) -> int | None:
        """The size of object `key` as last listed (None for keys given, or not listed yet)."""
        return self._sizes.get(key)

    def etag(self, key: str) -> str | None:
        """The ETag of object `key` as last listed (None for keys given, or not listed yet)."""
        return self._etags.get(key)

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


class _Listing:
    """Re-iterable streamed listing: each `async for` lists the prefix again."""

    def __init__(self, source: S3) -> None:
        self._source = source

    def __aiter__(self) -> AsyncIterator[str]:
        return self._source.iter_keys()


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
        connect_timeout, read_timeout, deadline, attempts, backoff, max_backoff, ssl, engine: as for
            `http()`.
    """
    return S3(url, keys, **options)
