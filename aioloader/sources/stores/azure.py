"""Azure Blob Storage: keys are blob names under az://container/prefix, listed with List Blobs.

Requests are signed with SharedKey (an account key), carry a SAS token in their query, or a bearer
token from azure-identity (see `azureauth.py` for where credentials are looked for), and go over the
project's transport: the same retries, backoff, deadlines and engines as `http()` and `s3()`.
Throttling (429, 503 ServerBusy, 500 OperationTimedOut) shrinks the number of requests in flight for
the whole source (AIMD, see `_tuning/aimd.py`); `stats()["concurrency_limit"]` shows the limit.
"""

from __future__ import annotations

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
from .azureauth import (
    AzureSigner,
    Found,
    find_credentials,
    list_query,
    parse_az_url,
    parse_listing,
)
from .listing import Bucket, Listing, Page, PageAt
from .manifest import Manifest

__all__ = ["Azure", "azure"]

MAX_PAGE = 5000  # List Blobs answers at most this many names per page
# Error codes that say "too many requests" whatever their status.
THROTTLE_CODES = frozenset({"ServerBusy", "OperationTimedOut"})


class Azure(Bucket):
    """The blobs under an Azure Blob Storage prefix, as a source. See `azure()` for the arguments.

    `keys()` lists every blob now (sorted, blocking); `iter_keys()` streams the listing page by page
    on the running loop. `fetch(key)` returns the blob's bytes in a `bytearray`; `fetch_range` part
    of it. Fetches are coroutines, safe to cancel, and raise `FetchError` naming the blob's URL (its
    SAS signature redacted) and Azure's error code (e.g. "AuthenticationFailed" for a wrong key).

    Example:
        >>> src = azure("az://data/train/", account_name="acct", account_key="a2V5")
        >>> src.url("train/0001.jpg")
        'https://acct.blob.core.windows.net/data/train/0001.jpg'
    """

    list_width = 1  # List Blobs' marker is opaque: a listing cannot start at a key, so no parts

    def __init__(
        self,
        url: str,
        keys: Sequence[str] | None = None,
        *,
        account_name: str | None = None,
        account_key: str | None = None,
        sas_token: str | None = None,
        credential: Any = None,
        connection_string: str | None = None,
        endpoint_url: str | None = None,
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
        shared = RemoteOptions.of(remote, options, "azure")
        check_int("page_size", page_size, minimum=1)
        where = parse_az_url(url)
        self.container, self.prefix = where.container, where.prefix
        for name, value in (("account_name", account_name), ("endpoint_url", endpoint_url)):
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"{name} must be a non-empty str, got {value!r}")
        if where.sas is not None and sas_token is not None:
            raise ValueError("a SAS token is in both url and sas_token: give one")
        found = find_credentials(
            account_name=account_name or where.account, account_key=account_key,
            sas_token=sas_token or where.sas, credential=credential,
            connection_string=connection_string, anonymous=anonymous,
        )  # fmt: skip
        endpoint, endpoint_from = _endpoint(endpoint_url, where.endpoint, found)
        if found.account is None:
            found.account = _path_account(endpoint)
        self.signer = AzureSigner(found)
        self.account = found.account
        self.base = f"{endpoint}/{quote(self.container, safe='')}/"
        self._sas = f"?{found.sas}" if found.sas else ""
        self.listing = Listing(self, self.where, self.prefix, "azure", keys, stream_keys, manifest)
        self.page_size = min(page_size, MAX_PAGE)
        self._options: dict[str, Any] = {
            **shared.transport_options(),
            "sign": self.signer,
            "redirects": False,
            "dns_hint": f"the endpoint is {redact_url(endpoint)!r}, from {endpoint_from}",
            "throttle_codes": THROTTLE_CODES,
            "suffix_ranges": False,  # x-ms-range takes no "bytes=-n"
        }
        concurrency = shared.concurrency
        self.limiter = Aimd(
            concurrency, min(min_concurrency, concurrency), ramp=Ramp.for_job(concurrency)
        )
        self.transport = Transport(limit=concurrency, limiter=self.limiter, **self._options)

    def __repr__(self) -> str:
        return (
            f"azure('az://{self.container}/{self.prefix}', base={redact_url(self.base)!r}, "
            f"auth={self.signer.kind if not self._sas else 'SAS token'})"
        )

    def url(self, key: str) -> str:
        """The URL of blob `key` (its full name within the container), with the SAS if any."""
        if not isinstance(key, str) or not key or "\x00" in key:
            raise InvalidKeyError(f"key {key!r} is not an Azure blob name")
        return self.base + quote(key, safe="/~") + self._sas

    @property
    def where(self) -> str:
        return f"az://{self.container}/{self.prefix}"

    def cache_name(self, key: str) -> str:
        """The account, container and blob name: one cached copy whatever the endpoint."""
        return f"az://{self.account or ''}/{self.container}/{key}"

    async def list_page(self, transport: Transport, at: PageAt) -> Page:
        """One page of the listing (`Pages`)."""
        query = list_query(self.prefix, self.page_size, at.token)
        sas = "&" + self._sas[1:] if self._sas else ""
        body = await transport.get(f"{self.base[:-1]}?{query}{sas}", key=self.where)
        try:
            page = parse_listing(bytes(body))
        except ValueError as exc:  # ParseError is a SyntaxError; bad ints are ValueErrors
            where = self.where
            raise FetchError(f"bad List Blobs answer for {where}: {exc}", key=where) from None
        return Page(page.objects, page.etags, page.next_marker)

    def list_transport(self) -> Transport:
        """A transport for listing on a thread of its own (`Pages`)."""
        return Transport(limit=4, **self._options)

    def stats(self) -> dict[str, float]:
        """The adaptive concurrency limit, the request counters and the cache's (`cache_dir`)."""
        return {**super().stats(), **self.limiter.stats()}


def _endpoint(given: str | None, from_url: str | None, found: Found) -> tuple[str, str]:
    """(the account's blob endpoint without a trailing "/", where it came from)."""
    for endpoint, where in ((given, "endpoint_url"), (from_url, "url"),
                            (found.endpoint, found.source)):  # fmt: skip
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
                raise ValueError(f"{where} must be an http(s) URL without a query, got "
                                 f"{redact_url(endpoint)!r}")  # fmt: skip
            return endpoint.rstrip("/"), where
    if not found.account:
        raise ValueError(
            "no Azure storage account: pass account_name= or endpoint_url=, use "
            "https://ACCOUNT.blob.core.windows.net/CONTAINER/... as the url, or set "
            "AZURE_STORAGE_ACCOUNT or AZURE_STORAGE_CONNECTION_STRING"
        )
    return f"https://{found.account}.blob.core.windows.net", "account_name"


def _path_account(endpoint: str) -> str | None:
    """The account an emulator's endpoint (http://host:port/ACCOUNT) names in its path."""
    first = urlsplit(endpoint).path.strip("/").split("/", 1)[0]
    return first or None


def azure(url: str, keys: Sequence[str] | None = None, **options: Any) -> Azure:
    """A source of the blobs under `url` in Azure Blob Storage (or an emulator such as Azurite).

    Args:
        url: "az://container/prefix" or "https://ACCOUNT.blob.core.windows.net/container/prefix"
            (with a SAS token as its query, if you like); keys are full blob names starting with
            the prefix.
        keys: the keys to read, when known (a manifest); None lists the prefix.
        account_name: the storage account (None: from the url, the connection string or
            AZURE_STORAGE_ACCOUNT).
        account_key, sas_token, credential, connection_string: credentials; one at most. None of
            them: AZURE_STORAGE_CONNECTION_STRING, then AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY
            or AZURE_STORAGE_SAS_TOKEN, then azure-identity's DefaultAzureCredential if installed.
            `credential` takes what the official SDK does: a SAS or key string,
            {"account_name", "account_key"}, a named-key, SAS or token credential.
        endpoint_url: the account's blob endpoint, e.g. "http://127.0.0.1:10000/devstoreaccount1"
            for Azurite (None: the connection string's, else https://ACCOUNT.blob.core.windows.net).
        anonymous: unauthenticated requests (a public container).
        concurrency, min_concurrency: the largest and smallest number of requests in flight.
        page_size: names per List Blobs page (at most 5000).
        stream_keys: `keys()` streams the listing (an async iterable) instead of listing it all first.
        manifest: a `Manifest` or the file `python -m aioloader manifest URL -o FILE` wrote: its
            keys, sizes and ETags, read instead of listing (ValueError if it lists another prefix).
            Without one, ranks of a torch.distributed job list the prefix once for the whole job.
        connect_timeout, read_timeout, deadline, attempts, backoff, max_backoff, ssl, engine: as for
            `http()`.
    """
    return Azure(url, keys, **options)
