"""Reading one HTTP response: the body into a buffer sized from Content-Length, and failures as values.

`read_body` allocates the whole buffer once when the length is known and copies each chunk aiohttp
hands over into its place (one copy, no concatenation); a body that ends early is a retryable
`Failure`. `failure_from` turns an aiohttp or socket error into a `Failure` that says whether retrying
may help, with any URL in its text redacted.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
from urllib.parse import urlsplit

import aiohttp

from .redact import redact_text

__all__ = [
    "Failure",
    "dns_failure",
    "error_detail",
    "error_text",
    "failure_from",
    "is_dns_error",
    "read_body",
]

# The most bytes of an error response read to find its code and message.
_ERROR_BODY_MAX = 16 * 1024
_XML_FIELD = re.compile(rb"<(Code|Message)>([^<]{0,300})</\1>")


class Failure(Exception):
    """Internal: one attempt failed. `retryable` says whether another attempt may succeed; `dns`
    that the host's name did not resolve."""

    def __init__(
        self,
        reason: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        dns: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.dns = dns


def is_dns_error(exc: BaseException) -> bool:
    """Whether `exc` says a host name did not resolve (directly, or as aiohttp's connector error)."""
    return isinstance(exc, socket.gaierror) or isinstance(
        getattr(exc, "os_error", None), socket.gaierror
    )


def dns_failure(host: str | None, text: str) -> Failure:
    """The failure of an attempt whose host did not resolve (retryable: DNS can fail for a moment)."""
    return Failure(f"host {host!r} does not resolve: {text}", retryable=True, dns=True)


async def read_body(resp: aiohttp.ClientResponse) -> bytearray:
    """The whole body of `resp`; raises a retryable `Failure` when it ends early or breaks."""
    size = resp.content_length
    content = resp.content
    try:
        if size is None:
            grown = bytearray()
            while True:
                chunk, end_of_chunk = await content.readchunk()
                if not chunk and not end_of_chunk:
                    return grown
                grown += chunk
        buf = bytearray(size)
        view = memoryview(buf)
        pos = 0
        while pos < size:
            chunk, end_of_chunk = await content.readchunk()
            if not chunk:
                if end_of_chunk:
                    continue
                break
            end = pos + len(chunk)
            if end > size:
                raise Failure(f"body longer than Content-Length {size}", retryable=True)
            view[pos:end] = chunk
            pos = end
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise failure_from(exc, resp.url) from None
    if pos < size:
        raise Failure(f"short body: {pos} of {size} bytes (Content-Length)", retryable=True)
    return buf


async def error_detail(resp: aiohttp.ClientResponse) -> str:
    """ ": Code: Message" from an S3-style XML error body, or ""; never the rest of the body."""
    try:
        body = await resp.content.read(_ERROR_BODY_MAX)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return ""
    return error_text(body, resp.url)


def error_text(body: bytes | bytearray | memoryview, url: object) -> str:
    """ ": Code: Message" from the start of an S3-style XML error body, ": message" from a JSON
    API's `{"error": {"message": ...}}` (GCS's), or ""."""
    head = bytes(body[:_ERROR_BODY_MAX])
    found = _XML_FIELD.findall(head)
    fields = {name.decode(): value.decode("utf-8", "replace") for name, value in found}
    if not fields:
        message = _json_error(head)
        return redact_text(f": {message[:300]}", url) if message else ""
    return redact_text(": " + ": ".join(fields[k] for k in ("Code", "Message") if k in fields), url)


def _json_error(head: bytes) -> str:
    if not head.lstrip().startswith(b"{"):
        return ""
    try:
        error = json.loads(head).get("error")
    except (ValueError, AttributeError):
        return ""
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else ""


def failure_from(exc: BaseException, url: object) -> Failure:
    """What an exception raised while sending or reading says, as a `Failure`."""
    text = redact_text(f"{type(exc).__name__}: {exc}".rstrip(": "), url)
    if is_dns_error(exc):
        return dns_failure(getattr(exc, "host", None) or urlsplit(str(url)).hostname, text)
    if isinstance(exc, aiohttp.ClientConnectorCertificateError | ssl.SSLCertVerificationError):
        return Failure(f"TLS certificate verification failed: {text}", retryable=False)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return Failure(f"body cut short: {text}", retryable=True)
    if isinstance(exc, TimeoutError):  # includes aiohttp's connect and read timeouts
        return Failure(f"timed out: {text}", retryable=True)
    if isinstance(exc, aiohttp.ClientConnectionError | OSError):
        return Failure(f"connection failed: {text}", retryable=True)
    return Failure(text, retryable=False)
