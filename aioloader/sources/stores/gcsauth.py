"""Google Cloud Storage credentials: where they are found, OAuth tokens kept fresh, HMAC signing.

`find_credentials` follows the order the official client libraries use: the arguments given, then
STORAGE_EMULATOR_HOST (anonymous, as the libraries treat an emulator), GOOGLE_APPLICATION_CREDENTIALS,
gcloud's application-default file, and last the metadata server of a Google Compute Engine VM. A
credentials file is made into google-auth's credentials of its type (the `aioloader[gcs]` extra):
a service account's key, an authorized user's refresh token (what `gcloud auth application-default
login` writes), an external account (workload identity federation) or an impersonated service
account; google-auth signs and exchanges them, in a thread (its HTTP blocks). `Tokens` keeps one
access token per source and refreshes it `REFRESH_MARGIN_S` before it expires, one refresh at a
time, off the event loop.

HMAC keys sign each request of the XML API with GOOG4-HMAC-SHA256 (`HmacSigner`), the V4 signature
with Google's names; `sign_v4` is that algorithm with the names as parameters.

No secret (private key, refresh token, client secret, access token, HMAC secret) is ever put into a
repr, an error or a log line: they describe themselves by `describe()`, which names where the
credentials came from and the account, never the secret.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import os
import ssl as _ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from ..transport.responses import Failure, failure_from
from ..transport.sigv4 import V4Names, sign_v4

__all__ = [
    "GOOG4",
    "REFRESH_MARGIN_S",
    "SCOPE",
    "Bearer",
    "Credentials",
    "Found",
    "HmacSigner",
    "Tokens",
    "find_credentials",
    "parse_gs_url",
]

SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
TOKEN_URI = "https://oauth2.googleapis.com/token"
REFRESH_MARGIN_S = 225.0  # refresh a token this long before it expires
TOKEN_TIMEOUT_S = 30.0  # one token request, connect to last byte
_ERROR_TEXT_MAX = 300
_METADATA_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"


def parse_gs_url(url: str) -> tuple[str, str]:
    """("bucket", "prefix") from "gs://bucket/prefix"."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme != "gs" or not parts.netloc:
        raise ValueError(f"expected gs://bucket/prefix, got {url!r}")
    return parts.netloc, parts.path.lstrip("/")


# -- OAuth credentials --------------------------------------------------------------------------


class Credentials:
    """Where OAuth access tokens come from. `describe()` names the source, never a secret."""

    refreshable = True  # a refused token may be replaced by asking again

    def __init__(self, origin: str) -> None:
        self.origin = origin  # e.g. "credentials_file='/x/key.json'"

    def describe(self) -> str:
        return self.origin

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    async def request(self, ssl: _ssl.SSLContext | bool) -> tuple[str, float]:
        """(a new access token, its lifetime in seconds); `ssl` verifies the token endpoint."""
        raise NotImplementedError


class _StaticToken(Credentials):
    """A token given as it is (`token=`): never refreshed."""

    refreshable = False

    def __init__(self, token: str) -> None:
        super().__init__("token=***")
        self._token = token

    async def request(self, ssl: _ssl.SSLContext | bool) -> tuple[str, float]:
        return self._token, float("inf")


class _KeyFile(Credentials):
    """A credentials file's JSON (`info`), made into google-auth's credentials of its `type`, which
    sign and refresh (in a thread: their HTTP blocks): a service account's key (a signed JWT), an
    authorized user's refresh token (gcloud's application-default file), an external account
    (workload identity federation: a subject token from a file, a URL, an executable or AWS,
    exchanged at the STS endpoint, impersonating a service account where it says so), or an
    impersonated service account. Pickled (into a worker process) as its JSON: the worker makes
    its own."""

    def __init__(self, info: Mapping[str, Any], origin: str) -> None:
        super().__init__(origin)
        self.kind = str(info.get("type"))
        if self.kind not in _MAKERS:
            raise ValueError(
                f"{origin}: credentials of type {info.get('type')!r} are not supported "
                f"(these are: {', '.join(repr(k) for k in _MAKERS)})"
            )
        self.info = dict(info)
        self.email = str(info.get("client_email") or "")
        self.token_uri = str(info.get("token_uri") or info.get("token_url") or TOKEN_URI)
        self._lock = threading.Lock()  # one refresh at a time (google-auth's are not thread-safe)
        self._creds: Any = self._made()  # a key that does not load fails here, named

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_creds": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def describe(self) -> str:
        if self.kind == "service_account":
            return f"service account {self.email!r} ({self.origin})"
        return f"{self.kind.replace('_', ' ')} ({self.origin})"

    def _made(self) -> Any:
        try:
            return _MAKERS[self.kind](self.info)
        except ImportError:  # pragma: no cover - google-auth comes with the [gcs] extra
            raise ImportError(
                f"{self.origin}: Google credentials need google-auth: pip install 'aioloader[gcs]'"
            ) from None
        except (ValueError, TypeError, KeyError) as exc:  # google-auth's own words; no secret
            what = exc.args[0] if exc.args and isinstance(exc.args[0], str) else type(exc).__name__
            raise ValueError(
                f"{self.origin}: its {self.kind} credentials do not load: {what}"
            ) from None

    async def request(self, ssl: _ssl.SSLContext | bool) -> tuple[str, float]:
        return await asyncio.to_thread(self._refresh, ssl)

    def _refresh(self, ssl: _ssl.SSLContext | bool) -> tuple[str, float]:
        from google.auth.exceptions import GoogleAuthError

        where = f"no OAuth token for {self.describe()} from {self.token_uri}"
        with self._lock:
            if self._creds is None:
                self._creds = self._made()
            try:
                self._creds.refresh(_google_request(ssl))
            except GoogleAuthError as exc:
                raise Failure(f"{where}: {_google_reason(exc, self.token_uri)}",
                              retryable=bool(exc.retryable)) from None  # fmt: skip
            token, expiry = self._creds.token, self._creds.expiry
        if not isinstance(token, str) or not token:
            raise Failure(f"{where}: the answer holds no access_token", retryable=False)
        if expiry is None:
            return token, float("inf")
        return token, (expiry.replace(tzinfo=dt.UTC) - dt.datetime.now(dt.UTC)).total_seconds()


def _service_account(info: dict[str, Any]) -> Any:
    from google.oauth2 import service_account

    made = service_account.Credentials.from_service_account_info
    return made(info, scopes=[SCOPE])  # type: ignore[no-untyped-call]


def _authorized_user(info: dict[str, Any]) -> Any:
    """(Made by its constructor: `from_authorized_user_info` sends every refresh to Google's
    token URI, whatever the file's `token_uri` says.)"""
    from google.oauth2 import credentials

    missing = [k for k in ("client_id", "client_secret", "refresh_token") if not info.get(k)]
    if missing:
        raise ValueError(f"no {missing[0]!r} (a non-empty string) in the credentials")
    return credentials.Credentials(  # type: ignore[no-untyped-call]
        None, refresh_token=info["refresh_token"], client_id=info["client_id"],
        client_secret=info["client_secret"], token_uri=info.get("token_uri") or TOKEN_URI,
        scopes=[SCOPE], quota_project_id=info.get("quota_project_id"),
    )  # fmt: skip


def _external_account(info: dict[str, Any]) -> Any:
    source = info.get("credential_source")
    source = source if isinstance(source, dict) else {}
    if str(source.get("environment_id", "")).startswith("aws"):
        from google.auth import aws as kind
    elif "executable" in source:
        from google.auth import pluggable as kind  # type: ignore[no-redef]
    else:
        from google.auth import identity_pool as kind  # type: ignore[no-redef]
    return kind.Credentials.from_info(info, scopes=[SCOPE])  # type: ignore[no-untyped-call]


def _impersonated(info: dict[str, Any]) -> Any:
    from google.auth import impersonated_credentials

    made = impersonated_credentials.Credentials.from_impersonated_service_account_info
    return made(info, scopes=[SCOPE])  # type: ignore[no-untyped-call]


def _external_authorized_user(info: dict[str, Any]) -> Any:
    from google.auth import external_account_authorized_user

    made = external_account_authorized_user.Credentials.from_info
    return made(info, scopes=[SCOPE])  # type: ignore[no-untyped-call]


# a credentials file's "type" -> google-auth's credentials of that type, made from its JSON (the
# type-specific constructors, not google-auth's generic loader, which warns against unchecked input)
_MAKERS: dict[str, Any] = {
    "service_account": _service_account,
    "authorized_user": _authorized_user,
    "external_account": _external_account,
    "impersonated_service_account": _impersonated,
    "external_account_authorized_user": _external_authorized_user,
}


def _google_request(ssl: _ssl.SSLContext | bool) -> Any:
    """google-auth's urllib3 transport, verifying as `ssl` says, each request `TOKEN_TIMEOUT_S`."""
    import urllib3
    from google.auth.transport.urllib3 import Request

    if isinstance(ssl, _ssl.SSLContext):  # (no retries of its own: the transport retries)
        http = urllib3.PoolManager(ssl_context=ssl, retries=False)
    elif ssl is False:
        http = urllib3.PoolManager(cert_reqs="CERT_NONE", retries=False)
    else:
        http = urllib3.PoolManager(retries=False)
    request = Request(http)  # type: ignore[no-untyped-call]
    return functools.partial(request, timeout=TOKEN_TIMEOUT_S)


def _google_reason(exc: BaseException, url: str) -> str:
    """What a google-auth error says, in the transport's words where the cause is the network
    (an OAuth error's "error: description"; never the request's secrets)."""
    cause: BaseException | None = exc
    while cause is not None:  # a TLS failure under urllib3's and google-auth's wrappers
        if isinstance(cause, _ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            cause
        ):
            return failure_from(_ssl.SSLCertVerificationError(str(cause)), url).reason
        cause = cause.__cause__ or cause.__context__
    first = exc.args[0] if exc.args else ""
    return (first if isinstance(first, str) else type(exc).__name__)[:_ERROR_TEXT_MAX]


class _Metadata(Credentials):
    """The default service account of a Compute Engine VM, from its metadata server. (One GET
    here: google-auth's reads GCE_METADATA_HOST once, at import, and asks for the account's
    details before each token.)"""

    def __init__(self, host: str, origin: str) -> None:
        super().__init__(origin)
        self.url = f"http://{host}{_METADATA_PATH}"

    async def request(self, ssl: _ssl.SSLContext | bool) -> tuple[str, float]:
        timeout = aiohttp.ClientTimeout(total=TOKEN_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await _token_call(
                session, self.url, self.describe(), headers={"Metadata-Flavor": "Google"}
            )


async def _token_call(
    session: aiohttp.ClientSession, url: str, who: str, *, headers: Mapping[str, str]
) -> tuple[str, float]:
    """One token request (a GET); a `Failure` (retryable when it may pass) naming `who`."""
    where = f"no OAuth token for {who} from {url}"
    try:
        async with session.get(url, headers=headers) as resp:
            text = await resp.text(errors="replace")
            status = resp.status
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        failed = failure_from(exc, url)  # not marked dns: the object's host is not the one at fault
        raise Failure(f"{where}: {failed.reason}", retryable=failed.retryable) from None
    if status != 200:
        retry = status in (408, 429) or status >= 500
        raise Failure(f"{where}: HTTP {status}{_oauth_error(text)}", retryable=retry, status=status)
    try:
        answer = json.loads(text)
        token, lifetime = answer["access_token"], float(answer.get("expires_in", 3600))
    except (ValueError, KeyError, TypeError):
        raise Failure(f"{where}: the answer holds no access_token", retryable=False) from None
    if not isinstance(token, str) or not token:
        raise Failure(f"{where}: the answer holds no access_token", retryable=False)
    return token, lifetime


def _oauth_error(text: str) -> str:
    """ ": error: description" from an OAuth error answer (never the request's secrets)."""
    try:
        answer = json.loads(text)
    except ValueError:
        return ""
    if not isinstance(answer, dict):
        return ""
    error = answer.get("error")
    if isinstance(error, dict):  # Google APIs' {"error": {"message": ...}}
        error = error.get("message")
    parts = [str(p) for p in (error, answer.get("error_description")) if p]
    return (": " + ": ".join(parts))[:_ERROR_TEXT_MAX] if parts else ""


# -- where the credentials are found ------------------------------------------------------------


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def read_credentials_file(path: str | os.PathLike[str], origin: str) -> Credentials:
    """The credentials a JSON key file holds (a service account's key, or an authorized user's)."""
    try:
        info = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{origin}: cannot read it: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"{origin}: not a JSON credentials file") from None
    if not isinstance(info, dict):
        raise ValueError(f"{origin}: not a JSON credentials file (an object)")
    return _KeyFile(info, origin)


def _gcloud_file() -> Path:
    config = _env("CLOUDSDK_CONFIG") or str(Path.home() / ".config" / "gcloud")
    return Path(config) / "application_default_credentials.json"


def _on_gce() -> bool:
    try:
        return "Google" in Path("/sys/class/dmi/id/product_name").read_text()
    except OSError:
        return False


@dataclass(frozen=True)
class Found:
    """What `find_credentials` found: OAuth credentials, HMAC keys, or neither (anonymous)."""

    oauth: Credentials | None = None
    hmac: HmacSigner | None = None

    def describe(self) -> str:
        if self.hmac is not None:
            return self.hmac.describe()
        return self.oauth.describe() if self.oauth is not None else "anonymous"


def find_credentials(
    *,
    token: str | None = None,
    credentials_file: str | os.PathLike[str] | None = None,
    hmac_key: Sequence[str] | None = None,
    anonymous: bool = False,
    emulator: bool = False,
) -> Found:
    """The credentials to use, from the arguments, then the environment (see the module docstring).

    `emulator`: the endpoint came from STORAGE_EMULATOR_HOST (then, with no argument given, none).
    """
    named = (("token", token), ("credentials_file", credentials_file), ("hmac", hmac_key),
             ("anonymous", anonymous or None))  # fmt: skip
    given = [name for name, value in named if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of token, credentials_file, hmac and anonymous, not {given}")
    if anonymous or (emulator and not given):
        return Found()
    if token is not None:
        if not isinstance(token, str) or not token:
            raise TypeError("token must be an OAuth access token (a non-empty str)")
        return Found(oauth=_StaticToken(token))
    if hmac_key is not None:
        return Found(hmac=HmacSigner.of(hmac_key))
    if credentials_file is not None:
        if not isinstance(credentials_file, str | os.PathLike):
            raise TypeError(f"credentials_file must be a path, got {credentials_file!r}")
        return Found(
            oauth=read_credentials_file(
                credentials_file, f"credentials_file={str(credentials_file)!r}"
            )
        )
    return Found(oauth=_from_environment())


def _from_environment() -> Credentials:
    if (path := _env("GOOGLE_APPLICATION_CREDENTIALS")) is not None:
        return read_credentials_file(path, f"GOOGLE_APPLICATION_CREDENTIALS={path!r}")
    gcloud = _gcloud_file()
    if gcloud.exists():
        return read_credentials_file(gcloud, f"gcloud's application-default file {str(gcloud)!r}")
    host = _env("GCE_METADATA_HOST")
    if host is not None:
        return _Metadata(host, f"the metadata server at GCE_METADATA_HOST={host!r}")
    if _on_gce():
        return _Metadata("metadata.google.internal", "the Compute Engine metadata server")
    raise ValueError(
        "no Google credentials found: no GOOGLE_APPLICATION_CREDENTIALS, no application-default "
        f"file at {str(gcloud)!r}, not on Compute Engine; pass credentials_file=, token=, hmac= or "
        "anonymous=True (for a public bucket or an emulator)"
    )


# -- access tokens, kept fresh ------------------------------------------------------------------


class Tokens:
    """One access token from `credentials`, refreshed `REFRESH_MARGIN_S` before it expires.

    `fresh()` (a coroutine) returns a valid token, asking for a new one when needed; concurrent
    callers on one loop share one request. Safe to use from several loops and threads one after
    another (each refresh runs on the loop that asked for it). Pickled without its token.
    """

    def __init__(self, credentials: Credentials, ssl: _ssl.SSLContext | bool = True) -> None:
        self.credentials = credentials
        self.ssl = ssl
        self.refreshes = 0
        self._token: str | None = None
        self._expires = 0.0  # time.time() at which the token should no longer be used
        self._lock = threading.Lock()
        self._pending: tuple[asyncio.AbstractEventLoop, asyncio.Task[str]] | None = None

    def __repr__(self) -> str:
        return f"Tokens({self.credentials.describe()})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_token=None, _expires=0.0, _lock=None, _pending=None, refreshes=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @property
    def token(self) -> str | None:
        """The current token (None before the first refresh); never log it."""
        return self._token

    def invalidate(self, token: str) -> bool:
        """Forget `token` (the server refused it); False if it was not the current one."""
        with self._lock:
            if self._token != token:
                return False
            self._token, self._expires = None, 0.0
            return True

    async def fresh(self) -> str:
        """A token good for at least `REFRESH_MARGIN_S` more (or one that never expires)."""
        with self._lock:
            if self._token is not None and time.time() < self._expires:
                return self._token
            loop = asyncio.get_running_loop()
            if self._pending is None or self._pending[0] is not loop or self._pending[1].done():
                task = loop.create_task(self._refresh())
                task.add_done_callback(_retrieve)  # its waiters may all have been cancelled
                self._pending = (loop, task)
            task = self._pending[1]
        return await asyncio.shield(task)

    async def _refresh(self) -> str:
        token, lifetime = await self.credentials.request(self.ssl)
        with self._lock:
            self._token = token
            self._expires = time.time() + max(0.0, lifetime - REFRESH_MARGIN_S)
            self.refreshes += 1
        return token


def _retrieve(task: asyncio.Task[str]) -> None:
    if not task.cancelled():
        task.exception()


class Bearer:
    """The transport's signer for OAuth: adds `Authorization: Bearer <the current token>`."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def __repr__(self) -> str:
        return f"Bearer({self.tokens.credentials.describe()})"

    def __call__(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        token = self.tokens.token
        return headers if token is None else {**headers, "Authorization": f"Bearer {token}"}

    async def ready(self) -> str:
        """A fresh token (`Tokens.fresh`), for the transport to sign with (`Prepares`)."""
        return await self.tokens.fresh()

    def refused(self, made: str) -> str | None:
        """The server refused `made`: forget it, so that the retry asks for a new one (None where
        the credentials cannot be refreshed: the 401 stands)."""
        if not self.tokens.credentials.refreshable:
            return None
        if not self.tokens.invalidate(made):
            return ""  # refreshed meanwhile: the retry signs with the new one
        return "the OAuth token was refused, a new one will be asked for"


# -- HMAC keys: V4 signatures (`_sigv4.py`) with Google's names ---------------------------------


GOOG4 = V4Names("GOOG4-HMAC-SHA256", "GOOG4", "goog4_request", "x-goog", "storage", "auto")


class HmacSigner:
    """Signs XML API requests with an HMAC key (access id, secret): GOOG4-HMAC-SHA256."""

    def __init__(self, access_id: str, secret: str) -> None:
        self.access_id = access_id
        self._secret = secret

    @classmethod
    def of(cls, key: Sequence[str]) -> HmacSigner:
        if (
            isinstance(key, str)
            or not isinstance(key, Sequence)
            or len(key) != 2
            or not all(isinstance(k, str) and k for k in key)
        ):
            raise TypeError("hmac must be (access_id, secret), two non-empty strs")
        return cls(key[0], key[1])

    def describe(self) -> str:
        return f"HMAC key {self.access_id!r}"

    def __repr__(self) -> str:
        return f"HmacSigner({self.access_id!r}, secret=***)"

    def __call__(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        now = dt.datetime.now(dt.UTC)
        return sign_v4(GOOG4, self.access_id, self._secret, method, url, headers, now)
