"""The Azure Blob source against a real Azurite (SharedKey, SAS, connection strings) and its parsing."""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.azurite import ACCOUNT, KEY, AzuriteServer
from support.faultproxy import Fault, FaultProxy, Origin
from support.stores import FAST, PREFIXES, clear_store_setup, write_objects

from aioloader import FetchError, Loader
from aioloader.sources import azure
from aioloader.sources.stores.azureauth import (
    AzureSigner,
    AzUrl,
    find_credentials,
    list_query,
    parse_az_url,
    parse_connection_string,
    parse_listing,
)
from aioloader.sources.transport.client import Transport
from aioloader.sources.transport.retry import Retry, Timeouts

PREFIX = PREFIXES["azure"]


@pytest.fixture(autouse=True)
def no_azure_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees no store variables and no ~/.aws or gcloud files but the ones it writes."""
    clear_store_setup(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def stored(azurite: AzuriteServer) -> dict[str, bytes]:
    """Blobs under PREFIX written with the official SDK (odd names included), one outside it."""
    return write_objects("azure", azurite)  # the shared suite's (test_stores.py)


@pytest.fixture
def az_proxy(azurite: AzuriteServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of Azurite; its URL + /ACCOUNT is an endpoint (Host is the proxy's)."""
    server = FaultProxy(f"http://127.0.0.1:{azurite.port}")
    yield server
    server.stop()


def source(server: AzuriteServer, **options: Any) -> Any:
    options.setdefault("account_key", KEY)
    options.setdefault("account_name", ACCOUNT)
    return azure(f"az://{server.container}/{PREFIX}", endpoint_url=server.endpoint, **options)


def container_sas(server: AzuriteServer, **permission: bool) -> str:
    """A container SAS made by the official SDK, valid for an hour."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    return str(
        generate_container_sas(
            ACCOUNT,
            server.container,
            account_key=KEY,
            permission=ContainerSasPermissions(**permission),
            expiry=datetime.now(UTC) + timedelta(hours=1),
        )
    )


def sig_of(sas: str) -> str:
    return next(p.partition("=")[2] for p in sas.split("&") if p.startswith("sig="))


# -- against Azurite -------------------------------------------------------------------------------


def test_sas_token_reads_and_is_never_shown(
    azurite: AzuriteServer, stored: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    sas = container_sas(azurite, read=True, list=True)
    src = azure(f"az://{azurite.container}/{PREFIX}", sas_token=sas, endpoint_url=azurite.endpoint)
    with Loader(src, collate=None) as loader:
        assert [bytes(x) for x in loader] == [stored[k] for k in sorted(stored, key=str.encode)]
    # the SAS as the query of an https URL (the endpoint overridden: Azurite is not on Azure's hosts)
    in_url = f"https://{ACCOUNT}.blob.core.windows.net/{azurite.container}/{PREFIX}?{sas}"
    assert azure(in_url, endpoint_url=azurite.endpoint).keys() == sorted(stored, key=str.encode)
    read_only = container_sas(azurite, read=True)  # may not list
    caplog.set_level(logging.DEBUG, logger="aioloader")
    bad = azure(f"az://{azurite.container}/{PREFIX}", sas_token=read_only,
                endpoint_url=azurite.endpoint)  # fmt: skip
    with pytest.raises(FetchError, match="status 403") as refused:
        bad.keys()
    shown = f"{refused.value} {refused.value.key} {bad!r} {src!r} {caplog.text}"
    assert "sig=REDACTED" in str(refused.value)  # the URL is named, its signature is not
    for secret in (sig_of(sas), sig_of(read_only), read_only):
        assert secret not in shown


def test_a_sas_signature_stays_out_of_retry_logs_and_errors(
    azurite: AzuriteServer,
    stored: dict[str, bytes],
    az_proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sas = container_sas(azurite, read=True, list=True)
    az_proxy.plan = lambda path, n: (
        Fault("server-busy") if path.endswith("0004.bin") or n == 1 else None
    )
    keys = [k for k in sorted(stored) if "/0" in k][:8]
    src = azure(f"az://{azurite.container}/{PREFIX}", keys, sas_token=sas,
                endpoint_url=f"{az_proxy.url}/{ACCOUNT}", attempts=3, deadline=2.0,
                **FAST)  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="aioloader")
    with Loader(src, collate=None, on_error="skip", max_skipped=None) as loader:
        got = [bytes(x) for x in loader]
        skipped = repr(loader.stats().skipped)
    assert got == [stored[k] for k in keys if not k.endswith("0004.bin")]  # the SAS was accepted
    assert "retrying" in caplog.text
    assert "sig=REDACTED" in caplog.text
    for shown in (caplog.text, skipped, repr(src)):
        assert sig_of(sas) not in shown


def test_connection_strings_from_argument_and_environment(
    azurite: AzuriteServer, stored: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"az://{azurite.container}/{PREFIX}"
    expected = sorted(stored, key=str.encode)
    assert azure(url, connection_string=azurite.connection_string()).keys() == expected
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    from_env = azure(url)
    assert from_env.keys() == expected
    assert from_env.signer.source == "AZURE_STORAGE_CONNECTION_STRING"
    sas = container_sas(azurite, read=True, list=True)
    with_sas = f"BlobEndpoint={azurite.endpoint};SharedAccessSignature={sas}"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", with_sas)
    assert azure(url).keys() == expected
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    assert azure(url, endpoint_url=azurite.endpoint).keys() == expected


def test_a_wrong_key_is_refused_naming_the_url_and_no_secret(
    azurite: AzuriteServer, stored: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "d3Jvbmcta2V5LW9mLXRoZS1yaWdodC1sZW5ndGgtMDEyMzQ1Njc4OWFiY2RlZg=="
    src = azure(f"az://{azurite.container}/{PREFIX}",
                connection_string=azurite.connection_string(key=wrong))  # fmt: skip
    with pytest.raises(FetchError, match="status 403") as refused:
        src.keys()
    text = str(refused.value)
    assert f"{azurite.endpoint}/{azurite.container}?restype=container&comp=list" in text
    assert "AuthorizationFailure" in text
    assert "after 1 attempt" in text  # a refusal is not retried
    for shown in (text, repr(src), caplog.text):
        assert wrong not in shown
        assert KEY not in shown

    async def fetch() -> None:
        try:
            await src.fetch(f"{PREFIX}0001.bin")
        finally:
            await src.aclose()

    with pytest.raises(FetchError, match=r"0001\.bin.*status 403"):
        asyncio.run(fetch())


# -- faults, through the proxy ---------------------------------------------------------------------


def proxied(azurite: AzuriteServer, proxy: FaultProxy, keys: list[str], **options: Any) -> Any:
    options = {"concurrency": 8, **FAST, **options}
    return azure(f"az://{azurite.container}/{PREFIX}", keys,
                 connection_string=azurite.connection_string(f"{proxy.url}/{ACCOUNT}"),
                 **options)  # fmt: skip


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.in_process
def test_storms_resets_truncation_and_stalls_still_deliver_every_key_once(
    engine: str, azurite: AzuriteServer, stored: dict[str, bytes], az_proxy: FaultProxy
) -> None:
    kinds = ["server-busy", "500-timed-out", "429", "503", "reset", "truncate", "reset-mid-body",
             "stall"]  # fmt: skip
    keys = [k for k in sorted(stored) if "/0" in k]  # simple names: the proxy keeps their quoting

    def plan(path: str, n: int) -> Fault | None:
        if n > 2:
            return None
        kind = kinds[(zlib.crc32(path.encode()) + n) % len(kinds)]
        return Fault(kind, seconds=2.0 if kind == "stall" else 0.0)

    az_proxy.plan = plan
    src = proxied(azurite, az_proxy, keys, engine=engine, read_timeout=0.3)
    with Loader(src, collate=None, concurrency=8) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in keys]  # each once, in order, whole
    assert sum(az_proxy.injected.values()) == 2 * len(keys)
    # each blob was asked for after its two faults (a reset of a kept-alive connection is resent
    # by the client's connection layer, so not every fault is one of the transport's retries)
    assert all(az_proxy.seen[path] >= 3 for path in az_proxy.seen)
    stats = src.stats()
    assert stats["retries"] >= len(keys)
    assert stats["throttles"] >= 1  # ServerBusy, OperationTimedOut, 429 and 503 count
    assert stats["failures"] == 0


def test_a_storm_that_never_ends_names_the_key(
    azurite: AzuriteServer, stored: dict[str, bytes], az_proxy: FaultProxy
) -> None:
    bad = f"{PREFIX}0005.bin"
    az_proxy.plan = lambda path, n: Fault("server-busy") if path.endswith("0005.bin") else None
    keys = [k for k in sorted(stored) if "/0" in k]
    src = proxied(azurite, az_proxy, keys, attempts=3, deadline=1.0)
    with Loader(src, collate=None) as loader, pytest.raises(FetchError) as failed:
        list(loader)
    assert failed.value.key == bad
    assert "(status 503): deadline of 1 s passed" in str(failed.value)  # throttled: to the end
    assert max(az_proxy.seen.values()) > 3  # more than `attempts`
    assert "ServerBusy" in str(failed.value)


def test_cancel_deadline_and_early_break(
    azurite: AzuriteServer, stored: dict[str, bytes], az_proxy: FaultProxy
) -> None:
    keys = [k for k in sorted(stored) if "/0" in k]
    az_proxy.plan = lambda path, n: Fault("stall", 5.0) if path.endswith("0001.bin") else None
    src = proxied(azurite, az_proxy, keys, deadline=0.5, read_timeout=10.0)

    async def cancel_then_deadline() -> None:
        try:
            stalled = asyncio.create_task(src.fetch(keys[1]))
            await asyncio.sleep(0.1)
            stalled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stalled
            assert src.stats()["in_flight"] == 0  # the cancelled request gave its slot back
            assert bytes(await src.fetch(keys[0])) == stored[keys[0]]
            start = time.monotonic()
            with pytest.raises(FetchError, match=r"deadline of 0\.5 s"):
                await src.fetch(keys[1])
            assert time.monotonic() - start < 3.0
        finally:
            await src.aclose()

    asyncio.run(cancel_then_deadline())
    az_proxy.plan = lambda path, n: Fault("latency", 0.05)
    early = proxied(azurite, az_proxy, keys)
    with Loader(early, collate=None, concurrency=8) as loader:
        for i, x in enumerate(loader):
            assert bytes(x) == stored[keys[i]]
            if i == 2:
                break
    assert az_proxy.seen.total() < 2 * len(keys)


def test_a_source_pickles_and_reads_in_a_fresh_loop(
    azurite: AzuriteServer, stored: dict[str, bytes]
) -> None:
    src = source(azurite)
    key = f"{PREFIX}0002.bin"
    copy = pickle.loads(pickle.dumps(src))

    async def read() -> bytes:
        try:
            return bytes(await copy.fetch(key))
        finally:
            await copy.aclose()

    assert asyncio.run(read()) == stored[key]


# -- without a server ------------------------------------------------------------------------------


def test_urls_and_endpoints() -> None:
    assert parse_az_url("az://c/p/x") == AzUrl("c", "p/x")
    assert parse_az_url("https://acct.blob.core.windows.net/c/p/") == AzUrl(
        "c", "p/", "acct", "https://acct.blob.core.windows.net"
    )
    with_sas = parse_az_url("https://acct.blob.core.windows.net/c/p/?sv=1&sig=s3cr3t")
    assert with_sas.sas == "sv=1&sig=s3cr3t"
    assert "s3cr3t" not in repr(with_sas)
    src = azure("https://acct.blob.core.windows.net/data/train/", account_key="a2V5")
    assert src.url("train/a b.jpg") == "https://acct.blob.core.windows.net/data/train/a%20b.jpg"
    assert azure("az://c/", account_name="acct", anonymous=True).base == (
        "https://acct.blob.core.windows.net/c/"
    )
    for bad in ("s3://b/p", "az:///p", "https://example.com/c/p?sig=s3cr3t"):
        with pytest.raises(ValueError, match="url: expected") as err:
            parse_az_url(bad)
        assert "s3cr3t" not in str(err.value)
    with pytest.raises(ValueError, match="no Azure storage account"):
        azure("az://c/", anonymous=True)
    with pytest.raises(ValueError, match="endpoint_url must be an http"):
        azure("az://c/", anonymous=True, endpoint_url="ftp://x")
    with pytest.raises(TypeError, match="azure\\(\\) got an unexpected keyword argument 'regio'"):
        azure("az://c/", anonymous=True, account_name="a", regio="x")


def test_connection_string_parsing_never_quotes_the_secret() -> None:
    cs = parse_connection_string(
        f"AccountName=acct;AccountKey={KEY};EndpointSuffix=core.chinacloudapi.cn"
    )
    assert (cs.account, cs.endpoint) == ("acct", "https://acct.blob.core.chinacloudapi.cn")
    assert KEY not in repr(cs)
    dev = parse_connection_string("UseDevelopmentStorage=true")
    assert (dev.account, dev.key, dev.endpoint) == (
        ACCOUNT,
        KEY,
        "http://127.0.0.1:10000/devstoreaccount1",
    )
    for bad, says in (("AccountName=a;no-equals-sign", "not Name=value"),
                      ("AccountName=a", "neither AccountKey"),
                      (f"AccountKey={KEY}", "neither AccountName")):  # fmt: skip
        with pytest.raises(ValueError, match=says) as err:
            parse_connection_string(bad, "AZURE_STORAGE_CONNECTION_STRING")
        assert KEY not in str(err.value)
        assert "AZURE_STORAGE_CONNECTION_STRING" in str(err.value)


def test_credential_precedence_and_bad_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    def find(**given: Any) -> Any:
        args: dict[str, Any] = dict.fromkeys(
            ("account_name", "account_key", "sas_token", "credential", "connection_string"), None
        )
        return find_credentials(**{**args, "anonymous": False, **given})

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", "envacct")
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    assert find().source == "AZURE_STORAGE_KEY"
    assert find(sas_token="sv=1&sig=abcd").source == "sas_token"  # an argument beats the variables
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"AccountName=cs;AccountKey={KEY}")
    assert find().source == "AZURE_STORAGE_CONNECTION_STRING"
    both = find(connection_string=f"AccountName=cs;AccountKey={KEY};SharedAccessSignature=sig=x")
    assert (both.key, both.sas) == (KEY, None)  # the key signs; the SAS is not sent too
    assert find(credential={"account_name": "n", "account_key": KEY}).account == "n"
    assert find(credential="sv=1&sig=abcd").sas == "sv=1&sig=abcd"
    with pytest.raises(ValueError, match="give one of account_key, sas_token"):
        find(account_key=KEY, sas_token="sig=x")
    with pytest.raises(ValueError, match="account_key is not base64") as err:
        find(account_key="not base64!")
    assert "not base64!" not in str(err.value)
    with pytest.raises(ValueError, match="sas_token must be a SAS token"):
        find(sas_token="sv=1")
    with pytest.raises(TypeError, match="credential must be"):
        find(credential=42)


def test_default_azure_credential_is_the_last_resort() -> None:
    pytest.importorskip("azure.identity")
    found = find_credentials(account_name="acct", account_key=None, sas_token=None,
                             credential=None, connection_string=None, anonymous=False, env={})  # fmt: skip
    assert found.source == "DefaultAzureCredential"  # made, not asked for a token (no network here)


class CountingToken:
    """A token credential (anything with get_token) whose tokens expire after `life` seconds; a
    call blocks while `held` is clear (a credential that is slow to answer)."""

    def __init__(self, life: float) -> None:
        self.life, self.calls = life, 0
        self.held = threading.Event()
        self.held.set()
        self.asked = threading.Event()  # a call is waiting for `held`
        self.answered = threading.Semaphore(0)  # released as each call returns

    def get_token(self, *scopes: str) -> Any:
        from types import SimpleNamespace

        self.calls += 1
        self.asked.set()
        assert self.held.wait(10)
        self.answered.release()
        return SimpleNamespace(token=f"tok{self.calls}", expires_on=time.time() + self.life)


def _bearer_signer(cred: Any) -> AzureSigner:
    return AzureSigner(find_credentials(account_name="a", account_key=None, sas_token=None,
                       credential=cred, connection_string=None, anonymous=False))  # fmt: skip


def test_bearer_tokens_are_reused_then_fetched_anew_beside_the_requests() -> None:
    async def three(cred: CountingToken) -> list[str | None]:
        """Three tokens asked for, the third once the credential answered every call made."""
        signer = _bearer_signer(cred)
        sent = [await signer.ready(), await signer.ready()]
        for _ in range(cred.calls):
            assert await asyncio.to_thread(cred.answered.acquire, True, 5)
        third = await signer.ready()
        # (the fetch thread keeps the token it got just after the credential answered: an event
        # this side cannot wait on, so it looks again until the token kept is the new one)
        while cred.calls > 1 and third == sent[0]:
            await asyncio.sleep(0.001)
            third = await signer.ready()
        return [*sent, third]

    lasting, expiring, ending = CountingToken(3600), CountingToken(120), CountingToken(10)
    assert asyncio.run(three(lasting)) == ["tok1", "tok1", "tok1"]
    # within TOKEN_EARLY_S of its end, a token is still sent while the next one is fetched
    assert asyncio.run(three(expiring)) == ["tok1", "tok1", "tok2"]
    # within TOKEN_LAST_S, the next one is waited for
    signer = _bearer_signer(ending)
    assert asyncio.run(signer.ready()) == "tok1"
    assert asyncio.run(signer.ready()) == "tok2"
    # signed without `ready()` (a direct call): a token ending within TOKEN_LAST_S is not sent
    assert (
        signer("GET", "https://a.blob.core.windows.net/c/x", {})["Authorization"] == "Bearer tok3"
    )
    assert "tok3" not in repr(signer)


def test_a_slow_token_refresh_holds_no_other_fetch() -> None:
    """A credential that takes its time (2 s and more) to answer: the fetches signed with a token
    still good go on meanwhile, and where none is yet, other fetches on the loop do."""
    origin = Origin({f"o{i}": bytes([i]) * 64 for i in range(40)})
    try:

        async def run() -> None:
            options: dict[str, Any] = {
                "timeouts": Timeouts(5, 5, 30), "retry": Retry(attempts=2),
            }  # fmt: skip
            cred = CountingToken(120)  # within TOKEN_EARLY_S: fetched anew at the first use
            cold = CountingToken(3600)
            signed = Transport(limit=8, sign=_bearer_signer(cred), **options)
            plain = Transport(limit=8, **options)
            unready = Transport(limit=8, sign=_bearer_signer(cold), **options)
            try:
                await steps(cred, cold, signed, plain, unready)
            finally:
                cred.held.set()
                cold.held.set()
                await asyncio.gather(signed.aclose(), plain.aclose(), unready.aclose())

        async def steps(
            cred: CountingToken, cold: CountingToken, signed: Transport, plain: Transport,
            unready: Transport,
        ) -> None:  # fmt: skip
            got = await signed.get(f"{origin.url}/o0", key="o0")  # tok1; tok2 asked for
            assert got == bytes(64)
            assert await asyncio.to_thread(cred.asked.wait, 5)
            cred.held.clear()  # ... and the credential holds its answer from now on
            cred.asked.clear()
            ready = await asyncio.gather(
                *(signed.get(f"{origin.url}/o{i}", key=i) for i in range(1, 20))
            )  # every one of them while the refresh may take as long as it likes
            assert [bytes(b) for b in ready] == [bytes([i]) * 64 for i in range(1, 20)]
            cred.held.set()
            # no token at all: its fetches wait for one, and the loop goes on with the others
            cold.held.clear()
            waiting = asyncio.ensure_future(unready.get(f"{origin.url}/o20", key=20))
            assert await asyncio.to_thread(cold.asked.wait, 5)
            others = await asyncio.gather(
                *(plain.get(f"{origin.url}/o{i}", key=i) for i in range(21, 40))
            )
            assert len(others) == 19
            assert not waiting.done()
            cold.held.set()
            assert bytes(await waiting) == bytes([20]) * 64

        asyncio.run(run())
    finally:
        origin.stop()


def test_signer_headers_and_listing_parse() -> None:
    signer = AzureSigner(find_credentials(account_name="a", account_key=KEY, sas_token=None,
                         credential=None, connection_string=None, anonymous=False))  # fmt: skip
    headers = signer("GET", "https://a.blob.core.windows.net/c/x?comp=list", {"Range": "bytes=0-9"})
    assert headers["x-ms-range"] == "bytes=0-9"
    assert "Range" not in headers
    assert headers["Authorization"].startswith("SharedKey a:")
    assert KEY not in repr(signer)
    assert (
        list_query("p/", 10, "m 1")
        == "restype=container&comp=list&maxresults=10&prefix=p%2F&marker=m%201"
    )
    page = parse_listing(
        b"<?xml version='1.0'?><EnumerationResults><Blobs><Blob><Name>b</Name><Properties>"
        b"<Content-Length>12</Content-Length></Properties></Blob><Blob><Name>a</Name><Properties>"
        b"<Content-Length>3</Content-Length></Properties></Blob></Blobs><NextMarker>n2</NextMarker>"
        b"</EnumerationResults>"
    )
    assert (page.objects, page.next_marker) == ([("b", 12), ("a", 3)], "n2")
    assert (
        parse_listing(b"<EnumerationResults><Blobs/><NextMarker/></EnumerationResults>").next_marker
        is None
    )
