"""Azure Blob plumbing that is not HTTP: URLs, connection strings, credentials, SharedKey signing, listings.

Credentials are looked for where the official SDKs look, first found wins (`find_credentials`):
1. the arguments: `credential`, `account_key`, `sas_token`, `connection_string`;
2. AZURE_STORAGE_CONNECTION_STRING;
3. AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN;
4. azure-identity's DefaultAzureCredential, when that package is installed (a bearer token per
   request, fetched again a few minutes before it expires, in a thread of its own beside the
   requests: `AzureSigner.ready`).

An account key signs each request with SharedKey (HMAC-SHA256 of its canonical form under the
base64-decoded key, with x-ms-date and x-ms-version); a SAS token is added to every URL's query; a
bearer token goes in Authorization. No secret appears in a repr, a log line or an error: the SAS
signature (`sig=`) is redacted from URLs by `transport/redact.redact_url`, and keys and tokens are never
formatted into text.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import hashlib
import hmac
import inspect
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

from ..transport.redact import redact_url

__all__ = [
    "API_VERSION",
    "AzUrl",
    "AzureSigner",
    "Listing",
    "find_credentials",
    "list_query",
    "parse_az_url",
    "parse_connection_string",
    "parse_listing",
]

API_VERSION = "2021-12-02"  # x-ms-version sent with every request
TOKEN_SCOPE = "https://storage.azure.com/.default"
TOKEN_EARLY_S = 300.0  # fetch a bearer token again this long before it expires (beside requests)
TOKEN_LAST_S = 30.0  # ... and wait for the new one from this long before (not sent so near its end)
DEFAULT_SUFFIX = "core.windows.net"
# The emulator's account, published with it for local development (no secret).
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_DEV_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"
# The headers whose values are lines of the string to sign, in its order (after the verb).
_SIGNED_STANDARD = (
    "content-encoding", "content-language", "content-length", "content-md5", "content-type",
    "date", "if-modified-since", "if-match", "if-none-match", "if-unmodified-since", "range",
)  # fmt: skip


@dataclass(frozen=True)
class AzUrl:
    """What an Azure Blob URL names: the container and prefix, and (an https URL) the account, its
    endpoint and a SAS token in its query."""

    container: str
    prefix: str
    account: str | None = None
    endpoint: str | None = None
    sas: str | None = None

    def __repr__(self) -> str:
        sas = ", sas=***" if self.sas else ""
        return f"AzUrl({self.container!r}, {self.prefix!r}, account={self.account!r}{sas})"


def parse_az_url(url: str) -> AzUrl:
    """Parse "az://container/prefix" (the account and endpoint come from the arguments or the
    environment) or "https://ACCOUNT.blob.core.windows.net/container/prefix[?SAS]"."""
    if not isinstance(url, str):
        raise TypeError(
            f"url must be a str such as 'az://container/prefix', got {type(url).__name__}"
        )
    parts = urlsplit(url)
    if parts.scheme == "az" and parts.netloc and not parts.query:
        return AzUrl(parts.netloc, parts.path.lstrip("/"))
    host = parts.hostname or ""
    if parts.scheme in ("http", "https") and ".blob." in host:
        container, _, prefix = parts.path.lstrip("/").partition("/")
        if container:
            sas = _check_sas(parts.query, "url's query") if parts.query else None
            endpoint = f"{parts.scheme}://{parts.netloc}"
            return AzUrl(container, prefix, host.split(".", 1)[0], endpoint, sas)
    raise ValueError(
        "url: expected 'az://container/prefix' or "
        f"'https://ACCOUNT.blob.core.windows.net/container/prefix', got {redact_url(url)!r}"
    )


@dataclass(frozen=True)
class ConnectionString:
    """What an Azure Storage connection string says about Blob storage (None: not said)."""

    account: str | None
    key: str | None
    sas: str | None
    endpoint: str | None

    def __repr__(self) -> str:
        secret = "key=***" if self.key else "sas=***" if self.sas else "no secret"
        return f"ConnectionString(account={self.account!r}, endpoint={self.endpoint!r}, {secret})"


def parse_connection_string(text: str, name: str = "connection_string") -> ConnectionString:
    """Parse `text` ("AccountName=...;AccountKey=...;BlobEndpoint=...;..."); `name` is where it
    came from, for errors (which never quote it: it holds a secret)."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
    fields: dict[str, str] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        field, eq, value = part.partition("=")  # a key or a SAS holds "=": split at the first
        if not eq or not field.strip():
            raise ValueError(f"{name}: a part is not Name=value (the string is not shown)")
        fields[field.strip().lower()] = value.strip()
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        return ConnectionString(_DEV_ACCOUNT, _DEV_KEY, None, _DEV_ENDPOINT)
    account = fields.get("accountname")
    endpoint = fields.get("blobendpoint")
    if endpoint is None and account is not None:
        protocol = fields.get("defaultendpointsprotocol", "https")
        suffix = fields.get("endpointsuffix", DEFAULT_SUFFIX)
        endpoint = f"{protocol}://{account}.blob.{suffix}"
    key, sas = fields.get("accountkey"), fields.get("sharedaccesssignature")
    if key is None and sas is None:
        raise ValueError(f"{name}: neither AccountKey nor SharedAccessSignature is given")
    if endpoint is None:
        raise ValueError(f"{name}: neither AccountName nor BlobEndpoint is given")
    if account is None:
        account = _account_from_endpoint(endpoint)
    return ConnectionString(account, key, sas.lstrip("?") if sas else None, endpoint.rstrip("/"))


def _account_from_endpoint(endpoint: str) -> str | None:
    """The account an endpoint names: its host's first label, or (an emulator's
    http://host:port/ACCOUNT) its path's first segment."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    if ".blob." in host:
        return host.split(".", 1)[0]
    first = parts.path.strip("/").split("/", 1)[0]
    return first or None


@dataclass
class Found:
    """Credentials as found: one of key, sas, token (None for all: anonymous), and where from."""

    account: str | None = None
    endpoint: str | None = None
    key: str | None = None
    sas: str | None = None
    token: Any = None  # an object with get_token(scope) (azure-core's TokenCredential)
    source: str = "anonymous"


def find_credentials(
    *,
    account_name: str | None,
    account_key: str | None,
    sas_token: str | None,
    credential: Any,
    connection_string: str | None,
    anonymous: bool,
    env: Mapping[str, str] | None = None,
) -> Found:
    """The credentials to use, by the precedence in this module's docstring."""
    env = os.environ if env is None else env
    given = [n for n, v in (("account_key", account_key), ("sas_token", sas_token),
                            ("credential", credential), ("connection_string", connection_string),
                            ("anonymous", anonymous or None)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)}, not several")
    if anonymous:
        return Found(account=account_name)
    if account_key is not None:
        return Found(account_name, key=_check_key(account_key, "account_key"), source="account_key")
    if sas_token is not None:
        return Found(account_name, sas=_check_sas(sas_token, "sas_token"), source="sas_token")
    if credential is not None:
        return _from_credential(credential, account_name)
    if connection_string is not None:
        return _from_connection_string(connection_string, "connection_string")
    return _from_environment(account_name, env)


def _from_connection_string(text: str, name: str) -> Found:
    """A connection string's credentials: its AccountKey when it has one (its SAS is then unused,
    as in the SDK), else its SharedAccessSignature."""
    cs = parse_connection_string(text, name)
    if cs.key is not None:
        key = _check_key(cs.key, f"{name} (AccountKey)")
        return Found(cs.account, cs.endpoint, key=key, source=name)
    return Found(cs.account, cs.endpoint, sas=_check_sas(cs.sas, f"{name} (SharedAccessSignature)"),
                 source=name)  # fmt: skip


def _from_environment(account: str | None, env: Mapping[str, str]) -> Found:
    if text := env.get("AZURE_STORAGE_CONNECTION_STRING"):
        return _from_connection_string(text, "AZURE_STORAGE_CONNECTION_STRING")
    account = account or env.get("AZURE_STORAGE_ACCOUNT") or None
    if (key := env.get("AZURE_STORAGE_KEY")) and account:
        return Found(account, key=_check_key(key, "AZURE_STORAGE_KEY"), source="AZURE_STORAGE_KEY")
    if sas := env.get("AZURE_STORAGE_SAS_TOKEN"):
        return Found(
            account,
            sas=_check_sas(sas, "AZURE_STORAGE_SAS_TOKEN"),
            source="AZURE_STORAGE_SAS_TOKEN",
        )
    try:
        from azure.identity import DefaultAzureCredential  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        raise ValueError(
            "no Azure credentials: pass account_key=, sas_token=, credential= or "
            "connection_string=, set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT "
            "with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN), install azure-identity "
            "(aioloader[azure]), or pass anonymous=True for a public container"
        ) from None
    return Found(account, token=DefaultAzureCredential(), source="DefaultAzureCredential")


def _from_credential(credential: Any, account: str | None) -> Found:
    """`credential` as the SDK takes it: a SAS or key string, {"account_name", "account_key"}, a
    named-key or SAS credential object, or a token credential (anything with `get_token`)."""
    if isinstance(credential, str):
        if "sig=" in credential:
            return Found(account, sas=_check_sas(credential, "credential"), source="credential")
        return Found(account, key=_check_key(credential, "credential"), source="credential")
    if isinstance(credential, Mapping):
        if "account_key" not in credential:
            raise ValueError("credential: a mapping needs 'account_key' (and 'account_name')")
        name = credential.get("account_name") or account
        return Found(
            name, key=_check_key(credential["account_key"], "credential"), source="credential"
        )
    named = getattr(credential, "named_key", None)
    if named is not None:  # azure-core's AzureNamedKeyCredential
        return Found(named.name, key=_check_key(named.key, "credential"), source="credential")
    signature = getattr(credential, "signature", None)
    if isinstance(signature, str):  # azure-core's AzureSasCredential
        return Found(account, sas=_check_sas(signature, "credential"), source="credential")
    if callable(getattr(credential, "get_token", None)):
        return Found(account, token=credential, source="credential")
    raise TypeError(
        "credential must be a SAS token or account key (str), {'account_name', 'account_key'}, "
        f"a named-key, SAS or token credential, got {type(credential).__name__}"
    )


def _check_key(key: Any, name: str) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"{name} must be a base64 account key (a non-empty str)")
    try:
        base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            f"{name} is not base64 (an account key is; the value is not shown)"
        ) from None
    return key


def _check_sas(sas: Any, name: str) -> str:
    if not isinstance(sas, str) or "sig=" not in sas:
        raise ValueError(f"{name} must be a SAS token (a query string with sig=; not shown)")
    return sas.strip().lstrip("?")


class AzureSigner:
    """Adds Azure's headers to a request, and its authentication: SharedKey, bearer token or none
    (a SAS travels in the URL). Called by the transport once per attempt: (method, url, headers)
    -> the headers to send. A byte range goes as x-ms-range."""

    def __init__(self, found: Found) -> None:
        self.account = found.account
        self.source = found.source
        self._key = base64.b64decode(found.key) if found.key is not None else None
        if self._key is not None and not self.account:
            raise ValueError(
                f"an account key (from {found.source}) needs the account name: pass "
                "account_name=, or use https://ACCOUNT.blob.core.windows.net/... as the url"
            )
        self._credential = found.token
        self._token: tuple[str, float] | None = None  # (token, expires_on as time.time())
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[str] | None = None  # a token being fetched

    @property
    def kind(self) -> str:
        return "shared key" if self._key else "bearer token" if self._credential else "no header"

    def __repr__(self) -> str:
        return f"AzureSigner({self.kind}, account={self.account!r}, from {self.source})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lock=None, _token=None, _pending=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __call__(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        out = {k: v for k, v in headers.items() if k.lower() != "range"}
        ranged = next((v for k, v in headers.items() if k.lower() == "range"), None)
        if ranged is not None:
            out["x-ms-range"] = ranged
        out["x-ms-version"] = API_VERSION
        out["x-ms-date"] = formatdate(usegmt=True)
        if self._key is not None:
            assert self.account is not None
            signature = sign_shared_key(self._key, string_to_sign(method, url, out, self.account))
            out["Authorization"] = f"SharedKey {self.account}:{signature}"
        elif self._credential is not None:
            out["Authorization"] = f"Bearer {self._bearer()}"
        return out

    async def ready(self) -> str | None:
        """The bearer token to sign with (None without one), for the transport (`Prepares`).

        The credential's `get_token` blocks (an HTTP call, a CLI, a file), so it runs in a thread
        of its own, one fetch at a time, and the event loop goes on meanwhile (an async
        credential, such as azure.identity.aio's, is awaited instead). A token within
        `TOKEN_EARLY_S` of its expiry is still used while its successor is fetched beside the
        requests; only a missing one, or one within `TOKEN_LAST_S`, is waited for."""
        credential = self._credential
        if credential is None:
            return None
        token, now = self._token, time.time()
        if token is not None and now < token[1] - TOKEN_EARLY_S:
            return token[0]
        if inspect.iscoroutinefunction(credential.get_token):
            got = await credential.get_token(TOKEN_SCOPE)
            self._token = (str(got.token), float(got.expires_on))
            return self._token[0]
        fetching = self._fetching()
        if token is not None and now < token[1] - TOKEN_LAST_S:
            return token[0]  # good a while yet: the next one comes beside the requests
        return await asyncio.wrap_future(fetching)

    def refused(self, made: str | None) -> str | None:
        """A 401 answered the token `made`: forget it, so that the retry asks for a new one."""
        if made is None:
            return None  # not a bearer token's answer
        with self._lock:
            if self._token is None or self._token[0] != made:
                return ""  # fetched anew meanwhile: the retry signs with the new one
            self._token = None
        return "the bearer token was refused, a new one will be asked for"

    def _fetching(self) -> concurrent.futures.Future[str]:
        """The token being fetched, in a thread of its own (started here if none is)."""
        with self._lock:
            if self._pending is None or self._pending.done():
                self._pending = concurrent.futures.Future()
                threading.Thread(
                    target=self._fetch, args=(self._pending,), name="aioloader-azure-token",
                    daemon=True,
                ).start()  # fmt: skip
            return self._pending

    def _fetch(self, into: concurrent.futures.Future[str]) -> None:
        try:
            got = self._credential.get_token(TOKEN_SCOPE)
            token = (str(got.token), float(got.expires_on))
        except BaseException as exc:  # to whoever waits for it
            into.set_exception(exc)
            return
        with self._lock:
            self._token = token
        into.set_result(token[0])

    def _bearer(self) -> str:
        """The token `ready()` made ready; where it was not awaited (a direct call), the current
        one, fetched here when there is none or it expired."""
        with self._lock:
            if self._token is not None and time.time() < self._token[1] - TOKEN_LAST_S:
                return self._token[0]
        return self._fetching().result()


def string_to_sign(method: str, url: str, headers: Mapping[str, str], account: str) -> str:
    """SharedKey's canonical form of a request (Blob service, versions since 2015-02-21)."""
    lower = {k.lower(): v.strip() for k, v in headers.items()}
    if lower.get("content-length") == "0":
        lower["content-length"] = ""
    lines = [method.upper(), *(lower.get(name, "") for name in _SIGNED_STANDARD)]
    ms = sorted((k, " ".join(v.split())) for k, v in lower.items() if k.startswith("x-ms-"))
    return "\n".join(lines) + "\n" + "".join(f"{k}:{v}\n" for k, v in ms) + _resource(url, account)


def _resource(url: str, account: str) -> str:
    """The canonicalized resource: /account/path (as sent), then each query name:value, sorted."""
    parts = urlsplit(url)
    text = f"/{account}{parts.path or '/'}"
    query: dict[str, list[str]] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        query.setdefault(name.lower(), []).append(value)
    for name in sorted(query):
        text += f"\n{name}:{','.join(sorted(query[name]))}"
    return text


def sign_shared_key(key: bytes, text: str) -> str:
    """base64(HMAC-SHA256(key, text))."""
    return base64.b64encode(hmac.new(key, text.encode(), hashlib.sha256).digest()).decode()


def list_query(prefix: str, page_size: int, marker: str | None) -> str:
    """The query of one List Blobs request."""
    params = [("restype", "container"), ("comp", "list"), ("maxresults", str(page_size))]
    if prefix:
        params.append(("prefix", prefix))
    if marker:
        params.append(("marker", marker))
    return "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in params)


@dataclass
class Listing:
    """One page of a listing: (name, size) pairs, the marker of the next page (None: last), and each
    blob's ETag (which a cached copy is checked against)."""

    objects: list[tuple[str, int]]
    next_marker: str | None
    etags: dict[str, str] = field(default_factory=dict)


def parse_listing(body: bytes) -> Listing:
    """Parse a List Blobs answer (EnumerationResults)."""
    root = ET.fromstring(body)
    objects = []
    etags: dict[str, str] = {}
    blobs = root.find("Blobs")
    for blob in [] if blobs is None else blobs.findall("Blob"):
        name = blob.findtext("Name")
        if name is None:
            raise ValueError("a <Blob> without <Name>")
        size = blob.findtext("Properties/Content-Length") or "0"
        objects.append((name, int(size)))
        etag = blob.findtext("Properties/Etag")
        if etag:
            etags[name] = etag
    marker = (root.findtext("NextMarker") or "").strip()
    return Listing(objects, marker or None, etags)
