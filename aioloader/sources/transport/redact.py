"""Keep secrets out of logs, reprs and error messages: URLs are shown with their secrets replaced.

What counts as a secret in a URL: the userinfo (`user:password@`) and the value of every query
parameter whose name is not on an allow-list of names known to be harmless (`_HARMLESS`: paging,
listing, versions, image sizes, the non-secret parts of S3/GCS presigned URLs and Azure SAS tokens).
An unknown name (`?X-Custom-Auth=...`) is redacted: a secret shown by mistake cannot be taken back,
a harmless value hidden by mistake costs nothing.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit, urlunsplit

__all__ = ["REDACTED", "is_secret_param", "redact_text", "redact_url"]

REDACTED = "REDACTED"

_HARMLESS = frozenset(
    {
        # S3 and GCS presigned URLs, but for the signature and credential
        "x-amz-algorithm", "x-amz-date", "x-amz-expires", "x-amz-signedheaders",
        "x-goog-algorithm", "x-goog-date", "x-goog-expires", "x-goog-signedheaders",
        "expires", "versionid", "partnumber", "uploadid", "response-content-type",
        "response-content-disposition", "response-cache-control", "generation", "alt",
        # listing and paging
        "list-type", "prefix", "delimiter", "max-keys", "marker", "start-after", "encoding-type",
        "continuation-token", "fetch-owner", "page", "page_size", "per_page", "offset", "limit",
        "cursor", "maxresults", "pagetoken", "maxpagesize", "include",
        # Azure SAS tokens, but for `sig`; Azure Blob's own parameters
        "sv", "ss", "srt", "sp", "se", "st", "spr", "sr", "si", "sip", "ses", "skoid", "sktid",
        "skt", "ske", "sks", "skv", "comp", "restype", "blockid", "timeout", "snapshot",
        # content
        "format", "version", "v", "size", "width", "height", "w", "h", "q", "quality", "lang",
        "download", "raw", "ref", "branch", "revision", "rev", "dl", "name", "id", "index",
    }
)  # fmt: skip


def is_secret_param(name: str) -> bool:
    """True unless a query parameter called `name` is known to be harmless (see the docstring)."""
    return name.lower() not in _HARMLESS


def _redact_query(query: str) -> str:
    parts = []
    for pair in query.split("&"):
        name, eq, _ = pair.partition("=")
        parts.append(f"{name}={REDACTED}" if eq and is_secret_param(name) else pair)
    return "&".join(parts)


def redact_url(url: object) -> str:
    """`url` as text, with its userinfo and secret query values replaced by "REDACTED".

    Never raises: text that does not parse as a URL is returned as "<unparsable URL>".
    """
    text = str(url)
    try:
        parts = urlsplit(text)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
        query = _redact_query(parts.query) if parts.query else ""
        return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparsable URL>"


def redact_text(text: str, url: object) -> str:
    """`text` with every occurrence of `url` (and of its secret parts) replaced by its redacted form."""
    raw = str(url)
    if raw and raw in text:
        text = text.replace(raw, redact_url(raw))
    try:
        parts = urlsplit(raw)
    except ValueError:
        return text
    secrets = [parts.password or "", parts.username or ""] if parts.password else []
    for pair in parts.query.split("&"):
        name, eq, value = pair.partition("=")
        if eq and value and is_secret_param(name):
            secrets.append(value)
    for secret in secrets:
        if len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    return text
