"""Version-4 request signatures (HMAC-SHA256 over a canonical request), as S3 and GCS's XML API check them.

One algorithm under two sets of names: AWS's (`AWS4-HMAC-SHA256`, `x-amz-*` headers, for S3 and the
stores that speak its API) and Google's (`GOOG4-HMAC-SHA256`, `x-goog-*`, for HMAC keys on GCS).
Requests here are GETs without a body. The key derived from the secret for a day, region and service
is kept (four HMACs saved on every request); a signature itself carries the time, so each attempt
signs again.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

__all__ = ["EMPTY_SHA256", "V4Names", "aws4", "sign_v4"]

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class V4Names:
    """The names a V4 signature uses: AWS's (`aws4`), or Google's (`_gcsauth.GOOG4`)."""

    algorithm: str
    key_prefix: str
    terminator: str
    header_prefix: str
    service: str
    region: str


def _canonical_query(query: str) -> str:
    pairs = []
    for pair in query.split("&") if query else []:
        name, _, value = pair.partition("=")
        pairs.append((quote(unquote(name), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def sign_v4(
    names: V4Names,
    access_id: str,
    secret: str,
    method: str,
    url: str,
    headers: Mapping[str, str],
    now: dt.datetime,
) -> dict[str, str]:
    """`headers` plus the date, payload hash and Authorization headers of a V4 signature.

    The request has no body (its payload hash is that of b""); every header given is signed, with
    the host (the URL's, as both engines send it). The path is signed as the URL has it (encoded).
    """
    parts = urlsplit(url)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    out = {**headers, f"{names.header_prefix}-date": stamp,
           f"{names.header_prefix}-content-sha256": EMPTY_SHA256}  # fmt: skip
    signed = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
    signed["host"] = parts.netloc.rpartition("@")[2]
    names_signed = ";".join(sorted(signed))
    canonical = "\n".join([
        method, parts.path or "/", _canonical_query(parts.query),
        "".join(f"{k}:{signed[k]}\n" for k in sorted(signed)), names_signed, EMPTY_SHA256,
    ])  # fmt: skip
    scope = f"{stamp[:8]}/{names.region}/{names.service}/{names.terminator}"
    to_sign = "\n".join(
        [names.algorithm, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = _signing_key(names, secret, stamp[:8])
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"{names.algorithm} Credential={access_id}/{scope}, SignedHeaders={names_signed}, "
        f"Signature={signature}"
    )
    return out


def aws4(region: str) -> V4Names:
    """AWS's names, for S3 in `region`."""
    return V4Names("AWS4-HMAC-SHA256", "AWS4", "aws4_request", "x-amz", "s3", region)


@functools.lru_cache(maxsize=16)
def _signing_key(names: V4Names, secret: str, day: str) -> bytes:
    key = f"{names.key_prefix}{secret}".encode()
    for part in (day, names.region, names.service, names.terminator):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key
