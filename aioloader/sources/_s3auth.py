"""S3 plumbing that is not HTTP: credentials, SigV4 signing (botocore's signer), addressing, listings.

Signing is botocore's own `S3SigV4Auth` over an `AWSRequest`, once per attempt (a signature carries
the time). botocore logs each canonical request and signature at DEBUG on "botocore.auth"; those lines
can hold a session token, so a filter on that logger drops them.
"""

from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

__all__ = ["Listing", "Signer", "bucket_base", "list_query", "parse_listing", "parse_s3_url"]

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


def bucket_base(bucket: str, endpoint_url: str | None, region: str, addressing: str) -> str:
    """The URL objects of `bucket` hang from (ends with "/"), path-style or virtual-hosted."""
    if addressing not in ("auto", "path", "virtual"):
        raise ValueError(f"addressing must be 'auto', 'path' or 'virtual', got {addressing!r}")
    endpoint = (endpoint_url or f"https://s3.{region}.amazonaws.com").rstrip("/")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"endpoint_url must be an http(s) URL, got {endpoint_url!r}")
    if addressing == "auto":
        addressing = "virtual" if endpoint_url is None and _DNS_BUCKET.match(bucket) else "path"
    if addressing == "path":
        return f"{endpoint}/{quote(bucket, safe='')}/"
    if not _DNS_BUCKET.match(bucket):
        raise ValueError(f"bucket {bucket!r} cannot be a host name; use addressing='path'")
    return f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path}/"


def list_query(prefix: str, page_size: int, token: str | None) -> str:
    """The query of one ListObjectsV2 request, encoded as SigV4 expects."""
    params = [("list-type", "2"), ("max-keys", str(page_size)), ("prefix", prefix)]
    if token is not None:
        params.append(("continuation-token", token))
    return "&".join(f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(params))


@dataclass
class Listing:
    """One page of a listing: (key, size) pairs and the token of the next page (None: last page)."""

    objects: list[tuple[str, int]]
    next_token: str | None


def parse_listing(body: bytes) -> Listing:
    """Parse a ListObjectsV2 response (namespaced or not)."""
    root = ET.fromstring(body)
    objects, truncated, token = [], False, None
    for child in root:
        tag = child.tag.rpartition("}")[2]
        if tag == "Contents":
            fields = {c.tag.rpartition("}")[2]: c.text or "" for c in child}
            objects.append((fields.get("Key", ""), int(fields.get("Size") or 0)))
        elif tag == "IsTruncated":
            truncated = (child.text or "").strip().lower() == "true"
        elif tag == "NextContinuationToken":
            token = child.text
    return Listing(objects, token if truncated else None)


class Signer:
    """Signs requests with SigV4 for S3; credentials from `credentials` or botocore's standard chain.

    Args:
        credentials: a botocore `Credentials`, or (access_key, secret_key[, token]); None: the chain
            (environment, config and credentials files, profile, container and instance roles).
        profile: the profile to read when `credentials` is None.
        region: the signing region; None: the profile's region or "us-east-1".
        anonymous: send unsigned requests (public buckets).
    """

    def __init__(
        self,
        credentials: Credentials | Sequence[str] | None = None,
        *,
        profile: str | None = None,
        region: str | None = None,
        anonymous: bool = False,
    ) -> None:
        self.credentials: Any = None
        session = None
        if region is None or (credentials is None and not anonymous):
            session = botocore.session.Session(profile=profile)
        if anonymous:
            pass
        elif isinstance(credentials, Credentials):
            self.credentials = credentials
        elif credentials is not None:
            self.credentials = Credentials(*credentials)
        else:
            assert session is not None
            self.credentials = session.get_credentials()
            if self.credentials is None:
                raise ValueError(
                    "no AWS credentials found in the environment, config files or instance role; "
                    "pass credentials=(key, secret) or anonymous=True"
                )
        found = session.get_config_variable("region") if session is not None else None
        self.region: str = region or found or "us-east-1"
        _quiet_botocore()

    def __repr__(self) -> str:
        who = "anonymous" if self.credentials is None else "credentials=***"
        return f"Signer({who}, region={self.region!r})"

    def __call__(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """`headers` plus the SigV4 ones (Authorization, X-Amz-Date, X-Amz-Content-SHA256, ...)."""
        if self.credentials is None:
            return headers
        request = AWSRequest(method=method, url=url, headers=headers)
        S3SigV4Auth(self.credentials.get_frozen_credentials(), "s3", self.region).add_auth(request)
        return dict(request.headers.items())
