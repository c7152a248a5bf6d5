"""The HTTP source against real HTTP on 127.0.0.1: an object server behind a fault-injecting proxy."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from support.faultproxy import KINDS, Fault, FaultProxy, Origin

from aioloader import FetchError, InvalidKeyError, Loader
from aioloader.sources.http import Http, http

FAST = {"backoff": 0.01, "max_backoff": 0.05}
ENGINES = ["aiohttp", "fast"]


def load_all(src: Http, epochs: int = 1, concurrency: int = 8) -> list[list[bytes]]:
    """Every sample of `epochs` epochs, in delivery order (the loader is closed after)."""
    with Loader(src, concurrency=concurrency, collate=None) as loader:
        return [[bytes(x) for x in loader] for _ in range(epochs)]


def test_fetches_every_object_in_key_order(origin: Origin, objects: dict[str, bytes]) -> None:
    src = http(origin.url + "/", list(objects))
    (got,) = load_all(src)
    assert got == list(objects.values())
    assert src.stats()["retries"] == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.asyncio
async def test_fetch_returns_a_writable_buffer_and_ranges(
    engine: str, origin: Origin, objects: dict[str, bytes]
) -> None:
    src = http(origin.url, list(objects), engine=engine)
    key = "obj/00003.bin"
    try:
        whole = await src.fetch(key)
        assert isinstance(whole, bytearray)
        assert whole == objects[key]
        assert await src.fetch_range(key, 100, 50) == objects[key][100:150]
        assert await src.fetch_range(key, 1000) == objects[key][1000:]
        assert await src.fetch_range(key, 5, 0) == b""
    finally:
        await src.aclose()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.asyncio
async def test_missing_object_fails_at_once_with_status(engine: str, origin: Origin) -> None:
    src = http(origin.url, ["nope.bin"], **FAST, engine=engine)
    try:
        with pytest.raises(
            FetchError, match=r"nope\.bin failed after 1 attempt\(s\) \(status 404\)"
        ):
            await src.fetch("nope.bin")
    finally:
        await src.aclose()


def test_keys_must_stay_under_the_base() -> None:
    src = http("http://127.0.0.1:1/data", ["a"])
    assert src.url("a b/c.bin") == "http://127.0.0.1:1/data/a%20b/c.bin"
    for bad in ("../x", "a/../../x", ""):
        with pytest.raises(InvalidKeyError):
            src.url(bad)
    with pytest.raises(InvalidKeyError):
        http("ftp://host/x")


def mixed_faults(path: str, n: int) -> Fault | None:
    """Up to two faults per path (its first attempts), of kinds picked by the path."""
    kinds = [k for k in KINDS if k not in ("503-retry-after", "stall")]
    h = zlib.crc32(path.encode())
    if n > 1 + h % 2:
        return None
    return Fault(kinds[(h + n) % len(kinds)], 0.02)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_key_once_per_epoch_through_faults(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    proxy.plan = mixed_faults
    src = http(proxy.url, list(objects), attempts=4, read_timeout=2.0, **FAST, engine=engine)
    epochs = load_all(src, epochs=2, concurrency=16)
    assert epochs == [list(objects.values())] * 2
    assert set(proxy.injected) >= {"503", "429", "reset", "reset-mid-body", "truncate", "latency"}
    assert src.stats()["failures"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_stalls_time_out_and_retry_after_is_honoured(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    stalled, throttled = "obj/00001.bin", "obj/00002.bin"

    def plan(path: str, n: int) -> Fault | None:
        if n == 1 and path == stalled:
            return Fault("stall", 3.0)
        return Fault("503-retry-after") if n == 1 and path == throttled else None

    proxy.plan = plan
    src = http(proxy.url, [stalled, throttled], read_timeout=0.3, **FAST, engine=engine)
    start = time.monotonic()
    (got,) = load_all(src)
    assert got == [objects[stalled], objects[throttled]]
    assert 1.0 <= time.monotonic() - start < 2.5  # waited Retry-After: 1, not the whole stall
    assert proxy.seen[stalled] == proxy.seen[throttled] == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_a_body_that_keeps_coming_is_not_timed_out_however_long_it_takes(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    # read_timeout is the longest silence, not the longest body: eight pieces 0.15 s apart take
    # over 1 s, four times read_timeout, and arrive at the first attempt
    slow = "obj/00003.bin"
    proxy.plan = lambda path, n: Fault("trickle", 0.15) if path == slow else None
    src = http(proxy.url, [slow], read_timeout=0.3, **FAST, engine=engine)
    (got,) = load_all(src)
    assert got == [objects[slow]]
    assert proxy.seen[slow] == 1
    assert src.stats()["retries"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_persistent_failure_is_a_typed_error_naming_the_key(engine: str, proxy: FaultProxy) -> None:
    proxy.plan = lambda path, n: Fault("500") if path.endswith("00005.bin") else None
    keys = [f"obj/{i:05d}.bin" for i in range(10)]
    src = http(proxy.url, keys, attempts=3, **FAST, engine=engine)
    got = []
    with Loader(src, concurrency=4, collate=None) as loader, pytest.raises(FetchError) as info:
        got.extend(bytes(x) for x in loader)
    assert len(got) == 5  # every sample before the failed one was delivered, in order
    err = info.value
    assert err.key == "obj/00005.bin"
    assert err.stage == "fetch"
    assert "status 500" in str(err)  # a server error, not throttling: `attempts` attempts
    assert "after 3 attempt(s)" in str(err)
    assert proxy.seen["obj/00005.bin"] == 3


@pytest.mark.parametrize("engine", ENGINES)
def test_deadline_bounds_a_sample(engine: str, proxy: FaultProxy) -> None:
    proxy.plan = lambda path, n: Fault("stall", 3.0)
    src = http(proxy.url, ["obj/00000.bin"], deadline=0.4, read_timeout=10.0, **FAST, engine=engine)
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"deadline of 0\.4 s passed"):
        load_all(src)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("engine", ENGINES)
def test_no_connection_left_open_after_close(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes], wait_until: Callable[..., bool]
) -> None:
    src = http(proxy.url, list(objects), concurrency=8, engine=engine)
    with Loader(src, concurrency=8, collate=None) as loader:
        assert len(list(loader)) == len(objects)
        assert proxy.open_connections() > 0  # kept alive between requests
        assert 1 <= proxy.open_connections() <= 8
    assert src.transport._session is None
    assert wait_until(lambda: proxy.open_connections() == 0)


@pytest.mark.parametrize("engine", ENGINES)
def test_close_mid_epoch_closes_connections(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes], wait_until: Callable[..., bool]
) -> None:
    proxy.plan = lambda path, n: Fault("latency", 0.05)
    src = http(proxy.url, list(objects), concurrency=8, engine=engine)
    with Loader(src, concurrency=8, collate=None) as loader:
        for i, _ in enumerate(loader):
            if i == 3:
                break
    assert wait_until(lambda: proxy.open_connections() == 0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.asyncio
async def test_async_iteration_on_the_callers_loop(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes]
) -> None:
    proxy.plan = mixed_faults
    src = http(proxy.url, list(objects), attempts=4, **FAST, engine=engine)
    async with Loader(src, concurrency=8, collate=None, use_caller_loop=True) as loader:
        got = [bytes(x) async for x in loader]
    assert got == list(objects.values())
    assert src.transport._session is None


@pytest.mark.parametrize("engine", ENGINES)
def test_secrets_never_shown(
    engine: str, origin: Origin, objects: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    origin.token = "right-token"
    secrets = ["hunter2pass", "SIGabc123xyz", "TOKENqwerty9", "wrong-token-42"]
    query = f"?sig={secrets[1]}&token={secrets[2]}&X-Amz-Signature={secrets[1]}"
    sources = [
        http(
            f"http://user:{secrets[0]}@127.0.0.1:{origin.port}/{query}",
            list(objects)[:4],
            engine=engine,
        ),
        http(
            origin.url + query,
            list(objects)[:4],
            headers={"Authorization": f"Bearer {secrets[3]}"},
            engine=engine,
        ),
    ]
    caplog.set_level(logging.DEBUG)
    for src in sources:
        with pytest.raises(FetchError) as info:
            load_all(src)
        shown = [caplog.text, str(info.value), repr(info.value), repr(src), str(src.keys())]
        shown += getattr(info.value, "__notes__", [])
        assert "status 401" in str(info.value)
        assert "REDACTED" in str(info.value)
        for secret in secrets:
            assert not any(secret in text for text in shown), secret


@pytest.mark.parametrize("engine", ENGINES)
def test_whole_url_keys_are_redacted_and_fetch(
    engine: str, origin: Origin, objects: dict[str, bytes]
) -> None:
    names = list(objects)[:3]
    urls = [f"{origin.url}/{name}?X-Amz-Signature=s3cr3t{i}" for i, name in enumerate(names)]
    src = http(urls, engine=engine)
    keys = src.keys()
    assert all("s3cr3t" not in key and "REDACTED" in key for key in keys)
    (got,) = load_all(src)
    assert got == [objects[n] for n in names]
    with pytest.raises(ValueError, match="differ only in their secrets"):
        http([f"{origin.url}/a?sig=1", f"{origin.url}/a?sig=2"])


@pytest.fixture(scope="module")
def tls_origin(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A self-signed certificate for 127.0.0.1 (made with the openssl CLI)."""
    d = tmp_path_factory.mktemp("tls")
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
           "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
           "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl unavailable: {exc}")
    return str(d / "cert.pem"), d / "key.pem"


@pytest.mark.parametrize("engine", ENGINES)
def test_tls_is_verified_by_default(
    engine: str, tls_origin: tuple[str, Path], objects: dict[str, bytes]
) -> None:
    import ssl

    from aiohttp import web
    from support.faultproxy import ServerThread

    cert, key = tls_origin
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    app = web.Application()

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=b"secure")

    app.router.add_get("/{n:.*}", handler)
    server = ServerThread(app, "test-tls", ssl_context=server_ctx)
    try:
        url = f"https://127.0.0.1:{server.port}/"
        with pytest.raises(FetchError, match="certificate verification failed") as info:
            load_all(http(url, ["x"], **FAST, engine=engine))
        assert "after 1 attempt(s)" in str(info.value)
        trusted = ssl.create_default_context(cafile=cert)
        assert load_all(http(url, ["x"], ssl=trusted, engine=engine)) == [[b"secure"]]
    finally:
        server.stop()


@pytest.mark.in_process
def test_fast_engine_gives_way_to_aiohttp_without_content_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from aiohttp import web
    from support.faultproxy import ServerThread

    async def chunked(_request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(_request)
        await resp.write(b"first ")
        await resp.write(b"second")
        return resp

    app = web.Application()
    app.router.add_get("/{n:.*}", chunked)
    server = ServerThread(app, "test-chunked")
    try:
        src = http(server.url, ["a", "b"], engine="fast")
        caplog.set_level(logging.INFO, logger="aioloader")
        assert load_all(src) == [[b"first second", b"first second"]]
        assert src.transport.engine == "aiohttp"
        assert "gives way to aiohttp" in caplog.text
    finally:
        server.stop()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.asyncio
async def test_a_dns_failure_of_a_host_that_resolved_before_is_retried(
    engine: str, origin: Origin, objects: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only name resolution is stood in for: "flaky.test" resolves to 127.0.0.1, except on the
    second lookup, which fails as a resolver that hiccups would."""
    resolve = socket.getaddrinfo
    lookups: list[str] = []

    def flaky(host: object, *args: object, **kwargs: object) -> object:
        if host == "flaky.test":
            lookups.append(host)
            if len(lookups) == 2:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "127.0.0.1"
        return resolve(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    port = origin.url.rsplit(":", 1)[1]
    names = list(objects)[:2]
    src = http(f"http://flaky.test:{port}/", names, engine=engine, **FAST)
    try:
        assert await src.fetch(names[0]) == objects[names[0]]
        await src.aclose()  # the next fetch connects (and looks the name up) anew
        assert await src.fetch(names[1]) == objects[names[1]]
    finally:
        await src.aclose()
    assert len(lookups) == 3
    assert src.stats()["retries"] == 1


def test_the_arguments_every_remote_source_takes_come_one_by_one_or_as_one_object() -> None:
    from aioloader.sources import RemoteOptions, s3

    shared = RemoteOptions(concurrency=3, attempts=2, deadline=9.0)
    one_by_one = http("http://127.0.0.1:9/", ["a"], concurrency=3, attempts=2, deadline=9.0)
    together = http("http://127.0.0.1:9/", ["a"], remote=shared)
    overridden = http("http://127.0.0.1:9/", ["a"], remote=shared, concurrency=5)
    assert one_by_one.transport.limit == together.transport.limit == 3
    assert overridden.transport.limit == 5
    assert together.transport.retry == one_by_one.transport.retry
    with pytest.raises(TypeError, match="http\\(\\) got an unexpected keyword argument 'atempts'"):
        http("http://127.0.0.1:9/", ["a"], atempts=3)
    with pytest.raises(TypeError, match="s3\\(\\) got an unexpected keyword argument 'retries'"):
        s3("s3://bucket/", ["k"], endpoint_url="http://127.0.0.1:9", retries=3, anonymous=True)
