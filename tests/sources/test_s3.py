"""The S3 source against a real SeaweedFS server (SigV4-signed requests over aiohttp), and AIMD units."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from support.s3server import DOMAIN, SeaweedServer
from support.stores import FAST, PREFIXES, clear_store_setup, write_objects

from aioloader import FetchError, Loader
from aioloader._tuning.aimd import Aimd
from aioloader.sources.s3 import S3, s3
from aioloader.sources.stores.listobjects import list_query, parse_listing
from aioloader.sources.stores.s3auth import bucket_base

PREFIX = PREFIXES["s3"]


@pytest.fixture(autouse=True)
def no_aws_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees no store variables and no ~/.aws or gcloud files but the ones it writes."""
    clear_store_setup(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def stored(seaweed: SeaweedServer) -> dict[str, bytes]:
    """Objects under PREFIX (odd names included) plus one outside it, written once per session."""
    return write_objects("s3", seaweed)  # the shared suite's (test_stores.py)


def source(server: SeaweedServer, **options: object) -> S3:
    options.setdefault("credentials", server.credentials)
    return s3(f"s3://{server.bucket}/{PREFIX}", endpoint_url=server.endpoint, **options)


def key_and_body(key: str, raw: bytearray) -> tuple[str, bytes]:
    return key, bytes(raw)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_decode_with_key_gets_the_object_key(
    executor: str, seaweed: SeaweedServer, stored: dict[str, bytes]
) -> None:
    src = source(seaweed)
    with Loader(src, decode=key_and_body, decode_with_key=True, executor=executor, workers=2,
                shuffle=True, concurrency=8, collate=None) as loader:  # fmt: skip
        got = list(loader)
    assert dict(got) == stored  # every body with its own key, e.g. "s3test/dir a/ü+x=1.bin"
    assert [key for key, _ in got] != sorted(stored, key=str.encode)  # shuffled, still paired


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.asyncio
async def test_virtual_hosted_addressing_against_the_server(
    engine: str, seaweed: SeaweedServer, stored: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests go to http://BUCKET.s3.localhost:PORT/KEY, signed for that host, and the server
    (told its domain) finds the bucket in the host name. Only name resolution is stood in for:
    `*.s3.localhost` resolves to 127.0.0.1, as a wildcard DNS record would."""
    resolve = socket.getaddrinfo
    hosts: list[str] = []

    def wildcard(host: object, *args: object, **kwargs: object) -> object:
        if isinstance(host, str) and host.endswith("." + DOMAIN):
            hosts.append(host)
            host = "127.0.0.1"
        return resolve(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", wildcard)
    port = seaweed.endpoint.rsplit(":", 1)[1]
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", endpoint_url=f"http://{DOMAIN}:{port}",
             addressing="virtual", credentials=seaweed.credentials, engine=engine, **FAST)  # fmt: skip
    assert src.base == f"http://{seaweed.bucket}.{DOMAIN}:{port}/"
    try:
        keys = [key async for key in src.iter_keys()]
        assert keys == sorted(stored, key=str.encode)
        assert [bytes(await src.fetch(k)) for k in keys[:5]] == [stored[k] for k in keys[:5]]
        assert await src.fetch_range(keys[3], 5, 50) == stored[keys[3]][5:55]
    finally:
        await src.aclose()
    assert set(hosts) == {f"{seaweed.bucket}.{DOMAIN}"}
    wrong = s3(f"s3://{seaweed.bucket}/{PREFIX}", endpoint_url=f"http://{DOMAIN}:{port}",
               addressing="virtual", credentials=(seaweed.credentials[0], "wrong-secret-000"),
               engine=engine, **FAST)  # fmt: skip
    try:
        with pytest.raises(FetchError, match=r"status 403"):
            await wrong.fetch(keys[0])
    finally:
        await wrong.aclose()


def test_wrong_secret_is_refused_clearly(seaweed: SeaweedServer, stored: dict[str, bytes]) -> None:
    wrong = "not-the-secret-0000"
    src = source(seaweed, credentials=(seaweed.credentials[0], wrong), **FAST)
    with pytest.raises(FetchError, match=r"status 403.*SignatureDoesNotMatch") as info:
        src.keys()
    assert wrong not in str(info.value)
    listed = source(seaweed, keys=list(stored)[:2], credentials=(seaweed.credentials[0], wrong))
    with Loader(listed) as loader, pytest.raises(FetchError) as info:
        list(loader)
    assert "SignatureDoesNotMatch" in str(info.value)
    assert info.value.key == next(iter(stored))


def test_credentials_come_from_the_standard_chain(
    seaweed: SeaweedServer, stored: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.credentials[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.credentials[1])
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", endpoint_url=seaweed.endpoint)
    assert src.signer.region == "us-east-1"
    assert len(src.keys()) == len(stored)


def use_env_credentials(monkeypatch: pytest.MonkeyPatch, server: SeaweedServer) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.credentials[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.credentials[1])


def first_object(src: S3) -> bytes:
    """The first object under the source's prefix, listed and read through a Loader."""
    with Loader(src, collate=None) as loader:
        return bytes(next(iter(loader)))


def test_endpoint_comes_from_aws_endpoint_url(
    seaweed: SeaweedServer, stored: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    use_env_credentials(monkeypatch, seaweed)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}")
    assert src.base == f"{seaweed.endpoint}/{seaweed.bucket}/"  # path-style off AWS
    assert first_object(src) == stored[min(stored, key=str.encode)]
    # the S3-specific variable comes first; the global one now names a host that does not exist
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://nonexistent.invalid:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", seaweed.endpoint)
    assert (
        first_object(s3(f"s3://{seaweed.bucket}/{PREFIX}")) == stored[min(stored, key=str.encode)]
    )
    # and an explicit argument beats both
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://nonexistent.invalid:9")
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", endpoint_url=seaweed.endpoint)
    assert first_object(src) == stored[min(stored, key=str.encode)]


def write_aws_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str, creds: str
) -> None:
    (tmp_path / "config").write_text(config)
    (tmp_path / "credentials").write_text(creds)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))


def test_profile_gives_endpoint_region_and_credentials(
    seaweed: SeaweedServer,
    stored: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    key, secret = seaweed.credentials
    config = (
        "[default]\nregion = eu-west-1\nendpoint_url = http://nonexistent.invalid:9\n\n"
        f"[profile train]\nregion = eu-central-1\ns3 =\n  endpoint_url = {seaweed.endpoint}\n"
        "  addressing_style = path\n\n"
        f"[profile flat]\nendpoint_url = {seaweed.endpoint}\n"
    )
    creds = f"[train]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
    creds += f"[flat]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
    write_aws_files(tmp_path, monkeypatch, config, creds)
    first = stored[min(stored, key=str.encode)]
    monkeypatch.setenv("AWS_PROFILE", "train")  # the nested s3 sub-section's endpoint_url
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}")
    assert (src.base, src.signer.region) == (
        f"{seaweed.endpoint}/{seaweed.bucket}/",
        "eu-central-1",
    )
    assert first_object(src) == first
    monkeypatch.delenv("AWS_PROFILE")  # the argument, and the profile's own endpoint_url
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", profile="flat")
    assert src.signer.region == "us-east-1"
    assert first_object(src) == first
    assert s3("s3://b/p/", credentials=("AK", "SK")).base == "http://nonexistent.invalid:9/b/"


def test_region_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_aws_files(tmp_path, monkeypatch, "[default]\nregion = ap-south-1\n", "")

    def region(**options: object) -> str:
        return s3("s3://b/p/", credentials=("AK", "SK"), **options).signer.region

    assert region() == "ap-south-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-north-1")
    assert region() == "eu-north-1"
    monkeypatch.setenv("AWS_REGION", "sa-east-1")
    assert region() == "sa-east-1"
    assert region(region="us-west-2") == "us-west-2"
    src = s3("s3://my-bucket/p/", credentials=("AK", "SK"))
    assert src.base == "https://my-bucket.s3.sa-east-1.amazonaws.com/"


def test_bad_profile_and_endpoint_settings_name_themselves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    write_aws_files(tmp_path, monkeypatch, "[profile services-less]\nservices = gone\n", "")
    with pytest.raises(ValueError, match=r"^profile: no profile 'nope' in .*config"):
        s3("s3://b/p/", profile="nope", credentials=("AK", "SK"))
    monkeypatch.setenv("AWS_PROFILE", "nope")
    with pytest.raises(ValueError, match=r"^AWS_PROFILE: no profile 'nope'"):
        s3("s3://b/p/", credentials=("AK", "SK"))
    monkeypatch.delenv("AWS_PROFILE")
    with pytest.raises(ValueError, match=r"services = 'gone'"):
        s3("s3://b/p/", profile="services-less", credentials=("AK", "SK"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    with pytest.raises(ValueError, match=r"^AWS_ENDPOINT_URL must be an http\(s\) URL"):
        s3("s3://b/p/", credentials=("AK", "SK"))
    with pytest.raises(TypeError, match=r"^profile must be"):
        s3("s3://b/p/", profile=3, credentials=("AK", "SK"))


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
def test_a_host_that_never_resolved_fails_at_once(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://nonexistent.invalid:9000")
    src = s3("s3://b/p/", ["p/x.bin"], credentials=("AK", "SK"), engine=engine)
    assert src.transport.retry.attempts > 1
    with Loader(src) as loader, pytest.raises(FetchError) as info:
        list(loader)
    message = str(info.value)
    assert "after 1 attempt(s)" in message, message
    assert "'nonexistent.invalid' does not resolve" in message
    assert "'nonexistent.invalid' has never resolved" in message
    assert "from AWS_ENDPOINT_URL" in message
    assert src.stats()["retries"] == 0
    with pytest.raises(FetchError, match="after 1 attempt"):
        s3("s3://b/p/", credentials=("AK", "SK"), engine=engine).keys()  # the listing, too


def test_addressing_styles() -> None:
    aws = bucket_base("my-bucket", None, "eu-west-1", "auto")
    assert aws == "https://my-bucket.s3.eu-west-1.amazonaws.com/"
    assert bucket_base("my.bucket", None, "eu-west-1", "auto").endswith("amazonaws.com/my.bucket/")
    assert bucket_base("b1b", "http://127.0.0.1:9000", "x", "auto") == "http://127.0.0.1:9000/b1b/"
    assert bucket_base("b1b", "http://minio:9000", "x", "virtual") == "http://b1b.minio:9000/"
    with pytest.raises(ValueError, match="host name"):
        bucket_base("Bad_Bucket", None, "x", "virtual")
    src = s3("s3://my-bucket/p/", region="eu-west-1", credentials=("AK", "SK"))
    assert src.url("p/a b+c.jpg") == "https://my-bucket.s3.eu-west-1.amazonaws.com/p/a%20b%2Bc.jpg"
    headers = src.signer("GET", src.url("p/x"), {})
    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AK/")
    assert "SK" not in repr(src)
    assert "SK" not in repr(src.signer)


def test_listing_parse_and_query() -> None:
    body = (
        b'<?xml version="1.0"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<IsTruncated>true</IsTruncated><Contents><Key>a&amp;b</Key><Size>3</Size></Contents>"
        b"<NextContinuationToken>t/1=</NextContinuationToken></ListBucketResult>"
    )
    page = parse_listing(body)
    assert page.objects == [("a&b", 3)]
    assert page.next_token == "t/1="
    assert list_query("p q/", 10, "t/1=") == (
        "continuation-token=t%2F1%3D&list-type=2&max-keys=10&prefix=p%20q%2F"
    )


@pytest.mark.asyncio
async def test_aimd_halves_once_per_round_and_grows_back() -> None:
    limiter = Aimd(maximum=8)
    tickets = [await limiter.acquire() for _ in range(8)]
    waiter = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()  # full
    for ticket in tickets[:4]:
        limiter.release(ticket, throttled=True)
    assert limiter.limit == 4.0  # four throttles of one round: one halving
    assert limiter.decreases == 1
    assert not waiter.done()  # 4 still in flight under a limit of 4
    limiter.release(tickets[4])
    ticket = await asyncio.wait_for(waiter, 1)
    assert limiter.in_flight <= int(limiter.limit)
    for t in [*tickets[5:], ticket]:
        limiter.release(t)
    assert 4.0 < limiter.limit < 6.0  # additive: about +1/limit per success
    for _ in range(200):
        limiter.release(await limiter.acquire())
    assert limiter.limit == 8.0
    assert limiter.in_flight == 0


@pytest.mark.asyncio
async def test_aimd_cancelled_waiter_gives_its_slot_on() -> None:
    limiter = Aimd(maximum=1)
    held = await limiter.acquire()
    first = asyncio.ensure_future(limiter.acquire())
    second = asyncio.ensure_future(limiter.acquire())
    await asyncio.sleep(0)
    limiter.release(held)  # hands the slot to `first`...
    first.cancel()  # ...which is cancelled before it runs
    ticket = await asyncio.wait_for(second, 1)
    assert limiter.in_flight == 1
    limiter.release(ticket)
    assert limiter.in_flight == 0


def test_endpoint_precedence_among_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = (
        "[default]\nservices = local\nendpoint_url = http://global.test:1\n\n"
        "[services local]\ns3 =\n  endpoint_url = http://service.test:2\n\n"
        "[profile plain]\nendpoint_url = http://plain.test:3\n"
    )
    write_aws_files(tmp_path, monkeypatch, config, "")

    def base(**options: object) -> str:
        return s3("s3://b/p/", credentials=("AK", "SK"), **options).base

    assert base() == "http://service.test:2/b/"  # the services section's s3 endpoint first
    assert base(profile="plain") == "http://plain.test:3/b/"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env.test:4")
    assert base() == "http://env.test:4/b/"
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert base() == "https://s3.us-east-1.amazonaws.com/b/"  # AWS
    assert base(endpoint_url="http://arg.test:5") == "http://arg.test:5/b/"


def test_signer_matches_botocore_with_a_session_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 signer's headers are botocore's for the same request and time, a session token
    (temporary credentials) sent and signed."""
    import datetime as dt
    import types

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from aioloader.sources.stores import s3auth

    url = "http://127.0.0.1:9000/bkt/a%20b.bin"
    request = AWSRequest(method="GET", url=url, headers={"Range": "bytes=0-9"})
    S3SigV4Auth(Credentials("AK", "SK", "TOKEN"), "s3", "eu-west-1").add_auth(request)
    when = dt.datetime.strptime(request.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ")
    clock = types.SimpleNamespace(datetime=types.SimpleNamespace(now=lambda tz: when), UTC=dt.UTC)
    monkeypatch.setattr(s3auth, "dt", clock)
    signer = s3auth.Signer(("AK", "SK", "TOKEN"), region="eu-west-1")
    ours = signer("GET", url, {"Range": "bytes=0-9"})
    assert ours["X-Amz-Security-Token"] == "TOKEN"
    assert ours["Authorization"] == request.headers["Authorization"]
    assert "x-amz-security-token" in ours["Authorization"]
