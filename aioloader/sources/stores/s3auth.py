"""S3 plumbing that is not HTTP: configuration, credentials, SigV4 signing, addressing.

Where an argument is not given, the endpoint, region and credentials come from the environment and
the shared config files by the precedence the AWS CLI and SDKs use (`AwsConfig`); credentials by
botocore's chain, which also refreshes those that expire.

Requests are signed SigV4 by `transport/sigv4.sign_v4` once per attempt (a signature carries the time): the
same signature as botocore's `S3SigV4Auth` (a test compares them), at a fraction of its cost per
request, which an object store read at thousands of requests a second pays on the event loop.
botocore signs its own requests (refreshing credentials from a role) and logs what it signs at DEBUG
on "botocore.auth"; those lines can hold a session token, so a filter on that logger drops them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import botocore.session
from botocore.credentials import Credentials
from botocore.exceptions import ProfileNotFound

from ..transport.sigv4 import aws4, sign_v4

__all__ = [
    "AwsConfig",
    "Signer",
    "bucket_base",
    "parse_s3_url",
]

_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_SIGNING_DETAILS = ("CanonicalRequest", "StringToSign", "Signature")


class _DropSigningDetails(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_SIGNING_DETAILS))


def _quiet_botocore() -> None:
    logger = logging.getLogger("botocore.auth")
    if not any(isinstance(f, _DropSigningDetails) for f in logger.filters):
        logger.addFilter(_DropSigningDetails())


def parse_s3_url(url: str) -> tuple[str, str]:
    """("bucket", "prefix") from "s3://bucket/prefix"."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"expected s3://bucket/prefix, got {url!r}")
    return parts.netloc, parts.path.lstrip("/")


def bucket_base(
    bucket: str,
    endpoint_url: str | None,
    region: str,
    addressing: str,
    endpoint_from: str = "endpoint_url",
) -> str:
    """The URL objects of `bucket` hang from (ends with "/"), path-style or virtual-hosted.

    `endpoint_from` names where `endpoint_url` came from, for the error a bad one raises.
    """
    if addressing not in ("auto", "path", "virtual"):
        raise ValueError(f"addressing must be 'auto', 'path' or 'virtual', got {addressing!r}")
    endpoint = (endpoint_url or f"https://s3.{region}.amazonaws.com").rstrip("/")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{endpoint_from} must be an http(s) URL, got {endpoint_url!r}")
    if addressing == "auto":
        addressing = "virtual" if endpoint_url is None and _DNS_BUCKET.match(bucket) else "path"
    if addressing == "path":
        return f"{endpoint}/{quote(bucket, safe='')}/"
    if not _DNS_BUCKET.match(bucket):
        raise ValueError(f"bucket {bucket!r} cannot be a host name; use addressing='path'")
    return f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path}/"


def _env(name: str) -> str | None:
    return os.environ.get(name) or None  # an empty variable counts as unset, as in the AWS CLI


class AwsConfig:
    """The endpoint, region and credentials the environment and the shared AWS files give S3.

    Precedence, as in the AWS CLI and SDKs (an explicit argument to `s3()` beats all of these):
    - endpoint: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, then the profile's S3 `endpoint_url` (in its
      `services` section or its nested `s3 =` sub-section), then its `endpoint_url`; none of them
      when AWS_IGNORE_CONFIGURED_ENDPOINT_URLS (or the profile's `ignore_configured_endpoint_urls`)
      is true;
    - region: AWS_REGION, AWS_DEFAULT_REGION, then the profile's `region`;
    - credentials: botocore's chain (environment, the profile in the credentials and config files,
      container and instance roles).

    The profile is `profile`, else AWS_PROFILE, else "default"; the files are ~/.aws/config and
    ~/.aws/credentials unless AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE say otherwise. The files
    are read only when an environment variable does not answer.

    Raises:
        ValueError: naming `profile` (or AWS_PROFILE) when that profile is in neither file.
    """

    def __init__(self, profile: str | None = None) -> None:
        if profile is not None and (not isinstance(profile, str) or not profile):
            raise TypeError(f"profile must be a profile name (a non-empty str), got {profile!r}")
        self.profile = profile
        self._session: botocore.session.Session | None = None
        self._scoped: dict[str, Any] = {}

    @property
    def session(self) -> botocore.session.Session:
        """botocore's session for the profile, made (and the profile checked) on first use."""
        if self._session is None:
            session = botocore.session.Session(profile=self.profile)
            try:
                self._scoped = session.get_scoped_config()
            except ProfileNotFound:
                what = "profile" if self.profile is not None else "AWS_PROFILE"
                where = session.get_config_variable("config_file")
                raise ValueError(
                    f"{what}: no profile {session.profile!r} in {where} or the credentials file"
                ) from None
            self._session = session
        return self._session

    def scoped(self) -> dict[str, Any]:
        """The profile's settings from the config file (nested sub-sections as dicts)."""
        _ = self.session
        return self._scoped

    def endpoint_url(self) -> tuple[str | None, str]:
        """(the configured S3 endpoint or None, where it came from)."""
        if (_env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS") or "").lower() == "true":
            return None, "endpoint_url"
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if (value := _env(name)) is not None:
                return value, name
        scoped = self.scoped()
        if str(scoped.get("ignore_configured_endpoint_urls", "")).lower() == "true":
            return None, "endpoint_url"
        where = f"the endpoint_url of profile {self.session.profile or 'default'!r}"
        for value in (self._services().get("endpoint_url"), _nested(scoped, "s3")):
            if value:
                return str(value), where
        found = scoped.get("endpoint_url")
        return (str(found), where) if found else (None, "endpoint_url")

    def _services(self) -> dict[str, Any]:
        name = self.scoped().get("services")
        if not name:
            return {}
        section = self.session.full_config.get("services", {}).get(name)
        if not isinstance(section, dict):
            raise ValueError(f"the profile's services = {name!r}: no [services {name}] section")
        found = section.get("s3")
        return found if isinstance(found, dict) else {}

    def region(self) -> str | None:
        """The configured region, or None."""
        for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
            if (value := _env(name)) is not None:
                return value
        found = self.scoped().get("region")
        return str(found) if found else None

    def credentials(self) -> Any:
        """botocore's credentials from the chain, or None when it finds none."""
        return self.session.get_credentials()


def _nested(scoped: dict[str, Any], section: str) -> Any:
    found = scoped.get(section)
    return found.get("endpoint_url") if isinstance(found, dict) else None


class Signer:
    """Signs requests with SigV4 for S3; credentials from `credentials` or botocore's standard chain.

    Args:
        credentials: a botocore `Credentials`, or (access_key, secret_key[, token]); None: the chain
            (environment, config and credentials files, profile, container and instance roles).
        profile: the profile to read when `credentials` or `region` is None (see `AwsConfig`).
        region: the signing region; None: as `AwsConfig.region()` finds it, else "us-east-1".
        anonymous: send unsigned requests (public buckets).
        config: the `AwsConfig` to read (instead of one for `profile`).
    """

    def __init__(
        self,
        credentials: Credentials | Sequence[str] | None = None,
        *,
        profile: str | None = None,
        region: str | None = None,
        anonymous: bool = False,
        config: AwsConfig | None = None,
    ) -> None:
        config = config or AwsConfig(profile)
        self.credentials: Any = None
        if anonymous:
            pass
        elif isinstance(credentials, Credentials):
            self.credentials = credentials
        elif credentials is not None:
            self.credentials = Credentials(*credentials)
        else:
            self.credentials = config.credentials()
            if self.credentials is None:
                raise ValueError(
                    "no AWS credentials found in the environment, config files or instance role; "
                    "pass credentials=(key, secret) or anonymous=True"
                )
        self.region: str = region or config.region() or "us-east-1"
        self._names = aws4(self.region)
        _quiet_botocore()

    def __repr__(self) -> str:
        who = "anonymous" if self.credentials is None else "credentials=***"
        return f"Signer({who}, region={self.region!r})"

    async def ready(self) -> None:
        """Credentials that expire (a role's, SSO's, a process's) are refreshed off the event loop
        (`Prepares`): botocore refreshes them inside `get_frozen_credentials()`, which blocks on
        the call it makes; so where a refresh is due, that call runs in a thread, and the
        signature then finds them fresh. Keys that never expire are never waited for."""
        refresh_needed = getattr(self.credentials, "refresh_needed", None)
        if refresh_needed is not None and refresh_needed():
            await asyncio.to_thread(self.credentials.get_frozen_credentials)

    def refused(self, made: None) -> str | None:
        """A 401 answer is not the credentials' to mend (S3 says 403 for an expired token)."""
        return None

    def __call__(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """`headers` plus the SigV4 ones (Authorization, X-Amz-Date, X-Amz-Content-SHA256, ...)."""
        if self.credentials is None:
            return headers
        frozen = self.credentials.get_frozen_credentials()
        if frozen.token:
            headers = {**headers, "X-Amz-Security-Token": frozen.token}
        now = dt.datetime.now(dt.UTC)
        return sign_v4(self._names, frozen.access_key, frozen.secret_key, method, url, headers, now)
