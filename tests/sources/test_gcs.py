"""The GCS source against a real fake-gcs-server (objects written by the official client library), real
OAuth token exchanges with a local token endpoint, and the fault proxy in front."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.faultproxy import Fault, FaultProxy
from support.gcsserver import AuthGate, GcsServer, TokenServer
from support.stores import FAST, PREFIXES, clear_store_setup, write_objects

from aioloader import FetchError, InvalidKeyError, Loader, ProcessExecutor
from aioloader.sources import gcs
from aioloader.sources.gcs import GCS
from aioloader.sources.stores.gcsauth import GOOG4, REFRESH_MARGIN_S
from aioloader.sources.transport.sigv4 import V4Names, sign_v4

PREFIX = PREFIXES["gcs"]


@pytest.fixture(autouse=True)
def no_google_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees no store variables and no ~/.aws or gcloud files but the ones it writes."""
    clear_store_setup(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def stored(gcs_server: GcsServer) -> dict[str, bytes]:
    """Objects under PREFIX (odd names included) plus one outside it, written by the official SDK."""
    return write_objects("gcs", gcs_server)  # the shared suite's (test_stores.py)


def source(server: GcsServer, **options: Any) -> GCS:
    options.setdefault("anonymous", True)
    return gcs(f"gs://{server.bucket}/{PREFIX}", endpoint_url=server.endpoint, **options)


# -- reading ------------------------------------------------------------------------------------


def test_emulator_host_variable_means_anonymous(
    gcs_server: GcsServer, stored: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint.removeprefix("http://"))
    src = gcs(f"gs://{gcs_server.bucket}/{PREFIX}")  # no credentials anywhere: none needed
    assert src.endpoint == gcs_server.endpoint
    assert "anonymous" in repr(src)
    assert len(src.keys()) == len(stored)


# -- faults -------------------------------------------------------------------------------------


@pytest.fixture
def gcs_proxy(gcs_server: GcsServer) -> Iterator[FaultProxy]:
    server = FaultProxy(gcs_server.endpoint)
    yield server
    server.stop()


def mixed_faults(path: str, n: int) -> Fault | None:
    """The first two attempts at most objects fail in one of the ways a flaky store fails."""
    kinds = ["503", "429", "reset", "reset-mid-body", "truncate", "latency"]
    h = sum(path.encode())
    return Fault(kinds[(h + n) % len(kinds)], 0.02) if n <= 2 and h % 5 else None


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.in_process
def test_every_object_arrives_once_through_faults(
    engine: str, gcs_proxy: FaultProxy, gcs_server: GcsServer, stored: dict[str, bytes]
) -> None:
    gcs_proxy.plan = mixed_faults
    src = gcs(f"gs://{gcs_server.bucket}/{PREFIX}", endpoint_url=gcs_proxy.url, anonymous=True,
              attempts=4, engine=engine, page_size=10, **FAST)  # fmt: skip
    with Loader(src, concurrency=8, collate=None) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in sorted(stored, key=str.encode)]
    assert set(gcs_proxy.injected) >= {"503", "429", "reset", "reset-mid-body", "truncate"}
    assert src.stats()["retries"] > 0
    assert src.stats()["failures"] == 0


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
def test_a_persistent_failure_or_stall_is_a_typed_error_naming_the_key(
    engine: str, gcs_proxy: FaultProxy, gcs_server: GcsServer, stored: dict[str, bytes]
) -> None:
    keys = sorted(stored)[:6]
    bad = keys[3]
    gcs_proxy.plan = lambda path, n: Fault("500") if path.endswith(bad) else None
    src = gcs(f"gs://{gcs_server.bucket}/{PREFIX}", keys, endpoint_url=gcs_proxy.url,
              anonymous=True, attempts=3, engine=engine, **FAST)  # fmt: skip
    with Loader(src, concurrency=4, collate=None) as loader, pytest.raises(FetchError) as info:
        list(loader)
    assert info.value.key == bad
    assert "status 500" in str(info.value)  # not throttling: `attempts` attempts
    assert "3 attempt(s)" in str(info.value)
    gcs_proxy.reset_counts()
    gcs_proxy.plan = lambda path, n: Fault("stall", 3.0)
    stalled = gcs(f"gs://{gcs_server.bucket}/{PREFIX}", keys[:1], endpoint_url=gcs_proxy.url,
                  anonymous=True, deadline=0.4, engine=engine, **FAST)  # fmt: skip
    t0 = time.monotonic()
    with Loader(stalled, collate=None) as loader, pytest.raises(FetchError, match="deadline"):
        list(loader)
    assert time.monotonic() - t0 < 2.5


def test_early_break_and_cancellation_leave_nothing_open(
    gcs_proxy: FaultProxy, gcs_server: GcsServer, stored: dict[str, bytes]
) -> None:
    src = source(gcs_server, concurrency=8)
    with Loader(src, concurrency=8, collate=None) as loader:
        for i, _ in enumerate(loader):
            if i == 3:
                break
    assert src.transport._session is None  # closed with the loader
    gcs_proxy.plan = lambda path, n: Fault("stall", 5.0)
    stalled = gcs(f"gs://{gcs_server.bucket}/{PREFIX}", endpoint_url=gcs_proxy.url, anonymous=True)

    async def cancel_one() -> None:
        task = asyncio.ensure_future(stalled.fetch(f"{PREFIX}0000.bin"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stalled.aclose()

    asyncio.run(cancel_one())
    assert stalled.stats()["failures"] == 0


# -- credentials --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rsa_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _pem(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()  # fmt: skip


@pytest.fixture
def tokens(rsa_key: Any) -> Iterator[TokenServer]:
    server = TokenServer(
        rsa_key.public_key(), refresh=("client-1", "client-secret-xyz", "rt-secret-abc")
    )
    yield server
    server.stop()


@pytest.fixture
def gate(gcs_server: GcsServer, tokens: TokenServer) -> Iterator[AuthGate]:
    server = AuthGate(gcs_server.endpoint, tokens)
    yield server
    server.stop()


def service_account_file(path: Path, key: Any, token_uri: str) -> Path:
    info = {"type": "service_account", "project_id": "p", "private_key_id": "kid-1",
            "private_key": _pem(key), "client_email": "loader@p.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": token_uri}  # fmt: skip
    path.write_text(json.dumps(info))
    return path


def secrets_of(key: Any) -> list[str]:
    """Pieces of the private key's PEM that must never be shown."""
    body = "".join(_pem(key).splitlines()[1:-1])
    return [body[i : i + 40] for i in range(0, len(body) - 40, 200)]


@pytest.mark.in_process
def test_service_account_tokens_are_fetched_sent_refreshed_and_never_shown(
    gate: AuthGate, tokens: TokenServer, rsa_key: Any, stored: dict[str, bytes], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    key_file = service_account_file(tmp_path / "sa.json", rsa_key, f"{tokens.url}/token")
    src = gcs(
        f"gs://test-bucket/{PREFIX}", credentials_file=key_file, endpoint_url=gate.url, **FAST
    )
    assert "loader@p.iam.gserviceaccount.com" in repr(src)
    with Loader(src, concurrency=8, collate=None) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in sorted(stored, key=str.encode)]
    assert tokens.issued == ["token-1"]  # one exchange: the listing and the reads share it
    assert set(gate.used) == {"token-1"}
    assert gate.refused == 0
    assert tokens.claims[0]["iss"] == "loader@p.iam.gserviceaccount.com"
    assert tokens.claims[0]["scope"].endswith("devstorage.read_only")
    tokens.revoked.add("token-1")  # the server stops taking it: a 401, a new token, success

    async def after_revocation() -> bytes:
        try:
            return bytes(await src.fetch(f"{PREFIX}0001.bin"))
        finally:
            await src.aclose()

    assert asyncio.run(after_revocation()) == stored[f"{PREFIX}0001.bin"]
    assert tokens.issued == ["token-1", "token-2"]
    assert gate.refused == 1
    assert src.stats()["token_refreshes"] == 2
    shown = caplog.text + repr(src) + repr(src.transport.sign) + repr(src.credentials)
    assert not any(piece in shown for piece in secrets_of(rsa_key))
    assert "token-1" not in shown
    assert "token-2" not in shown


def test_a_token_is_refreshed_before_it_expires(
    gate: AuthGate, tokens: TokenServer, rsa_key: Any, stored: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    tokens.lifetime = REFRESH_MARGIN_S + 0.3  # good for 0.3 s more than the margin asks
    key_file = service_account_file(tmp_path / "sa.json", rsa_key, f"{tokens.url}/token")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    key = f"{PREFIX}0002.bin"
    src = gcs(f"gs://test-bucket/{PREFIX}", [key], endpoint_url=gate.url)

    async def twice() -> list[bytes]:
        try:
            first = [bytes(await src.fetch(key)), bytes(await src.fetch(key))]
            await asyncio.sleep(0.4)
            return [*first, bytes(await src.fetch(key))]
        finally:
            await src.aclose()

    assert asyncio.run(twice()) == [stored[key]] * 3
    assert tokens.issued == ["token-1", "token-2"]
    assert gate.used == {"token-1": 2, "token-2": 1}
    assert gate.refused == 0


def test_authorized_user_from_gclouds_file_and_the_metadata_server(
    gate: AuthGate, tokens: TokenServer, stored: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    gcloud = tmp_path / "gcloud"
    gcloud.mkdir()
    user = {"type": "authorized_user", "client_id": "client-1", "client_secret": "client-secret-xyz",
            "refresh_token": "rt-secret-abc", "token_uri": f"{tokens.url}/token"}  # fmt: skip
    (gcloud / "application_default_credentials.json").write_text(json.dumps(user))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcloud))
    src = gcs(f"gs://test-bucket/{PREFIX}", endpoint_url=gate.url)
    assert "application-default" in repr(src)
    assert src.keys() == sorted(stored, key=str.encode)
    assert tokens.grants["refresh_token"] == 1
    assert "rt-secret-abc" not in repr(src)
    assert "client-secret-xyz" not in repr(src)
    (gcloud / "application_default_credentials.json").unlink()
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{tokens.port}")
    vm = gcs(f"gs://test-bucket/{PREFIX}", endpoint_url=gate.url)
    assert len(vm.keys()) == len(stored)
    assert tokens.grants["metadata"] == 1
    assert set(gate.used) == {"token-1", "token-2"}


def test_bad_credentials_name_the_argument_and_show_no_secret(
    tokens: TokenServer, gate: AuthGate, rsa_key: Any, stored: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    url = f"gs://test-bucket/{PREFIX}"
    with pytest.raises(ValueError, match=r"no Google credentials found.*anonymous=True"):
        gcs(url)
    with pytest.raises(ValueError, match=r"credentials_file='/nonexistent/k.json': cannot read"):
        gcs(url, credentials_file="/nonexistent/k.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"credentials_file=.*bad.json.*not a JSON"):
        gcs(url, credentials_file=tmp_path / "bad.json")
    (tmp_path / "odd.json").write_text('{"type": "api_key"}')
    with pytest.raises(ValueError, match=r"'api_key' are not supported \(these are: 'service_"):
        gcs(url, credentials_file=tmp_path / "odd.json")
    (tmp_path / "ext.json").write_text('{"type": "external_account"}')
    with pytest.raises(
        ValueError, match=r"ext.json': its external_account credentials do not load"
    ):
        gcs(url, credentials_file=tmp_path / "ext.json")
    broken = {"type": "service_account", "client_email": "a@b", "private_key": "-----BEGIN x",
              "token_uri": f"{tokens.url}/token"}  # fmt: skip
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(
        ValueError, match=r"broken.json': its service_account credentials do not"
    ) as info:
        gcs(url, credentials_file=tmp_path / "broken.json")
    assert "BEGIN x" not in str(info.value)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))
    with pytest.raises(
        ValueError, match=r"^GOOGLE_APPLICATION_CREDENTIALS=.*none.json.*cannot read"
    ):
        gcs(url)
    with pytest.raises(
        ValueError, match=r"give one of token, credentials_file, hmac and anonymous"
    ):
        gcs(url, token="t", anonymous=True)
    with pytest.raises(TypeError, match=r"^hmac must be \(access_id, secret\)"):
        gcs(url, hmac="GOOG1ABC")
    # a key the token endpoint does not know: the read fails, naming the key, the token URL and
    # the OAuth error, once (a refused grant is not retried) and without a piece of the key
    from cryptography.hazmat.primitives.asymmetric import rsa

    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    wrong = service_account_file(tmp_path / "wrong.json", stranger, f"{tokens.url}/token")
    keys = sorted(stored)[:2]
    src = gcs(url, keys, credentials_file=wrong, endpoint_url=gate.url, **FAST)
    with Loader(src, collate=None) as loader, pytest.raises(FetchError) as failed:
        list(loader)
    message = str(failed.value)
    assert failed.value.key == keys[0]
    assert f"{tokens.url}/token" in message, message
    assert "invalid_grant" in message
    assert "wrong.json" in message
    assert "1 attempt(s)" in message
    assert not any(piece in message + repr(src) for piece in secrets_of(stranger))
    assert gate.used.total() == 0
    # a token given as it is and refused: the JSON API's error message, no retry, no token shown
    given = gcs(url, keys, token="ya29.not-a-token-given", endpoint_url=gate.url, **FAST)
    with Loader(given, collate=None) as loader, pytest.raises(FetchError) as refused:
        list(loader)
    assert "status 401): HTTP 401 Unauthorized: Invalid Credentials" in str(refused.value)
    assert "1 attempt(s)" in str(refused.value)
    assert "not-a-token-given" not in str(refused.value) + repr(given)


def test_workload_identity_federation_exchanges_its_subject_token(
    gate: AuthGate, tokens: TokenServer, stored: dict[str, bytes], tmp_path: Path
) -> None:
    # an external account (what `gcloud iam workload-identity-pools create-cred-config` writes):
    # a subject token from a file, exchanged at the STS endpoint for an access token
    subject = tmp_path / "oidc-token"
    subject.write_text("subject-secret-oidc")
    tokens.subject = "subject-secret-oidc"
    audience = (
        "//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/p/providers/x"
    )
    config = {"type": "external_account", "audience": audience,
              "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
              "token_url": f"{tokens.url}/token", "credential_source": {"file": str(subject)}}  # fmt: skip
    (tmp_path / "wif.json").write_text(json.dumps(config))
    keys = sorted(stored)[:3]
    src = gcs(f"gs://test-bucket/{PREFIX}", keys, credentials_file=tmp_path / "wif.json",
              endpoint_url=gate.url)  # fmt: skip
    assert "external account" in repr(src)
    with Loader(src, collate=None) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in keys]
    assert tokens.issued == ["token-1"]
    assert [e["audience"] for e in tokens.exchanges] == [audience]
    assert tokens.exchanges[0]["scope"].endswith("devstorage.read_only")
    assert set(gate.used) == {"token-1"}
    assert "subject-secret-oidc" not in repr(src)


# -- URLs, endpoints, HMAC signing --------------------------------------------------------------


def test_urls_endpoints_and_keys() -> None:
    src = gcs("gs://bkt/train/", anonymous=True)
    assert src.url("train/a b/ü.jpg") == (
        "https://storage.googleapis.com/storage/v1/b/bkt/o/train%2Fa%20b%2F%C3%BC.jpg?alt=media"
    )
    xml = gcs(
        "gs://bkt/train/", hmac=("GOOG1ID", "hmac-secret-value"), endpoint_url="https://h:443/"
    )
    assert xml.url("train/a b.jpg") == "https://h/bkt/train/a%20b.jpg"
    assert "hmac-secret-value" not in repr(xml) + repr(xml.transport.sign)
    for bad in ("s3://bkt/x", "gs:///x", "bkt/x"):
        with pytest.raises(ValueError, match=r"expected gs://bucket/prefix"):
            gcs(bad, anonymous=True)
    with pytest.raises(ValueError, match=r"^endpoint_url must be an http\(s\) URL"):
        gcs("gs://b/", anonymous=True, endpoint_url="ftp://x")
    for key in ("", "a\x00b", "a\nb"):
        with pytest.raises(InvalidKeyError):
            src.url(key)
    with pytest.raises(TypeError, match=r"gcs\(\) got an unexpected keyword argument 'region'"):
        gcs("gs://b/", anonymous=True, region="x")


def test_v4_signature_is_the_algorithm_botocore_implements() -> None:
    """`sign_v4` with the original names gives botocore's signature for the same request and
    time; with Google's names it is GOOG4-HMAC-SHA256."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    url = "http://127.0.0.1:9000/bkt/dir%20a/%C3%BC.bin?list-type=2&prefix=a%2Fb&max-keys=7"
    request = AWSRequest(method="GET", url=url, headers={"Range": "bytes=5-99"})
    S3SigV4Auth(Credentials("AKID", "secret-key"), "s3", "us-east-1").add_auth(request)
    when = dt.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    aws = V4Names("AWS4-HMAC-SHA256", "AWS4", "aws4_request", "x-amz", "s3", "us-east-1")
    ours = sign_v4(aws, "AKID", "secret-key", "GET", url, {"Range": "bytes=5-99"}, when)
    assert ours["Authorization"] == request.headers["Authorization"]
    goog = sign_v4(GOOG4, "GOOG1ID", "s", "GET", url, {}, when)
    assert goog["Authorization"].startswith(
        f"GOOG4-HMAC-SHA256 Credential=GOOG1ID/{when:%Y%m%d}/auto/storage/goog4_request, "
        "SignedHeaders=host;x-goog-content-sha256;x-goog-date, Signature="
    )
    assert goog["x-goog-date"] == request.headers["X-Amz-Date"]


def test_hmac_keys_read_through_the_xml_api(
    gcs_server: GcsServer, stored: dict[str, bytes]
) -> None:
    """The emulator checks no signature; this runs the XML API's listing and GETs, signed."""
    src = source(
        gcs_server, anonymous=False, hmac=("GOOG1TESTID", "hmac-secret-value"), engine="fast"
    )
    with Loader(src, concurrency=8, collate=None) as loader:
        got = {k: bytes(x) for k, x in zip(src.keys(), loader, strict=True)}
    assert got == stored
    assert src.size(f"{PREFIX}0003.bin") == len(stored[f"{PREFIX}0003.bin"])


def test_oauth_source_fetches_in_worker_processes(
    gate: AuthGate, tokens: TokenServer, rsa_key: Any, stored: dict[str, bytes], tmp_path: Path
) -> None:
    """Pickled into each worker without its token or lock, the source asks for its own there."""
    key_file = service_account_file(tmp_path / "sa.json", rsa_key, f"{tokens.url}/token")
    keys = sorted(stored)
    src = gcs(f"gs://test-bucket/{PREFIX}", keys, credentials_file=key_file, endpoint_url=gate.url)
    # both workers up first: where workers start slowly (the free-threaded venv's CUDA torch), the
    # first one up could fetch every key before the second asked for anything
    with ProcessExecutor(2) as pool:
        assert pool.wait_ready(timeout=60)
        with Loader(src, executor=pool, fetch_in_workers=True, concurrency=8,
                    collate=None) as loader:  # fmt: skip
            got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in keys]
    assert len(tokens.issued) == 2  # one per worker process
    assert set(gate.used) == set(tokens.issued)
    assert gate.refused == 0


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with `cryptography`."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_text(_pem(key))
    return directory / "cert.pem", directory / "key.pem"


def test_the_token_endpoint_is_reached_over_verified_tls(
    gate: AuthGate, rsa_key: Any, stored: dict[str, bytes], tmp_path: Path
) -> None:
    import ssl

    cert, key = self_signed(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    secure = TokenServer(rsa_key.public_key(), ssl_context=server_side)
    try:
        uri = f"https://127.0.0.1:{secure.port}/token"
        key_file = service_account_file(tmp_path / "sa.json", rsa_key, uri)
        keys = sorted(stored)[:2]
        untrusted = gcs(f"gs://test-bucket/{PREFIX}", keys, credentials_file=key_file,
                        endpoint_url=gate.url, **FAST)  # fmt: skip
        with Loader(untrusted, collate=None) as loader, pytest.raises(FetchError) as info:
            list(loader)
        assert "certificate verification failed" in str(info.value)
        assert uri in str(info.value)
        assert secure.issued == []
        gate.tokens = secure  # the gate takes the tokens this endpoint gives
        trusted = gcs(f"gs://test-bucket/{PREFIX}", keys, credentials_file=key_file,
                      endpoint_url=gate.url, ssl=ssl.create_default_context(cafile=cert))  # fmt: skip
        with Loader(trusted, collate=None) as loader:
            got = [bytes(x) for x in loader]
        assert got == [stored[k] for k in keys]
        assert secure.issued == ["token-1"]
    finally:
        secure.stop()
