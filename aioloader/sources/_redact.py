"""Keep secrets out of logs, reprs and error messages: URLs are shown with their secrets replaced.

What counts as a secret in a URL: the userinfo (`user:password@`) and the value of any query parameter
whose name is a known credential (`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`,
`token`, `sig`, ...) or contains one of the words in `_SECRET_WORDS`.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit, urlunsplit

__all__ = ["REDACTED", "is_secret_param", "redact_text", "redact_url"]

REDACTED = "REDACTED"

_SECRET_PARAMS = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "awsaccesskeyid",
        "signature",
        "sig",
        "token",
        "access_token",
        "id_token",
        "refresh_token",
        "api_key",
        "apikey",
        "key",
        "password",
        "passwd",
        "secret",
        "auth",
        "authorization",
        "code",
    }
)
_SECRET_WORDS = ("signature", "token", "secret", "password", "credential", "apikey", "api_key")


def is_secret_param(name: str) -> bool:
    """True when a query parameter called `name` carries a credential."""
    lname = name.lower()
    return lname in _SECRET_PARAMS or any(word in lname for word in _SECRET_WORDS)


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
