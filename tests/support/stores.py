"""The three object stores behind one face, for the suite they share (tests/sources/test_stores.py).

A `Store` holds a running server (SeaweedFS for S3, fake-gcs-server, Azurite), the objects the tests
write under its prefix (`objects(name)`: the same names and bodies the store's own test file reads),
and what differs between the stores where they otherwise behave alike: how a source is made (its
credentials, and an endpoint through a fault proxy), the error code of a missing object, the
answers a throttling store gives, and the options `tar_shards` takes for it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aioloader.sources import azure, gcs, s3
from support.azurite import ACCOUNT, KEY, AzuriteServer
from support.gcsserver import GcsServer
from support.s3server import SeaweedServer

__all__ = [
    "FAST",
    "PREFIXES",
    "SERVER_FIXTURES",
    "STORE_VARIABLES",
    "Store",
    "make_store",
    "objects",
]

# What a machine's setup could tell a store's source: the suite clears them all.
STORE_VARIABLES = [
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN",
]  # fmt: skip
FAST = {"backoff": 0.01, "max_backoff": 0.05}
PREFIXES = {"s3": "s3test/", "gcs": "gcstest/", "azure": "aztest/"}
SERVER_FIXTURES = {"s3": "seaweed", "gcs": "gcs_server", "azure": "azurite"}


def objects(name: str) -> dict[str, bytes]:
    """The objects each store's tests keep under its prefix (odd names included), by store name."""
    prefix = PREFIXES[name]
    if name == "azure":
        rng, count, odd = random.Random(5), 24, ["dir a/ü+x=1.bin", "z~tilde&amp.bin"]
        size = lambda i: 1500 + 89 * i  # noqa: E731
    else:
        rng, count = random.Random(3 if name == "s3" else 5), 30
        odd = ["dir a/ü+x=1.bin", "z~tilde&amp.bin"]
        if name == "gcs":
            odd = ["dir a/ü+x=1.bin", "z~tilde&amp;?.bin", "Upper.bin"]
        size = lambda i: 2048 + 97 * i  # noqa: E731
    names = [f"{prefix}{i:04d}.bin" for i in range(count)] + [prefix + n for n in odd]
    return {key: rng.randbytes(size(i)) for i, key in enumerate(names)}


def clear_store_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a test's autouse fixture calls: no store variables, no ~/.aws or gcloud files."""
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "absent-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))


_WRITTEN: dict[tuple[str, Any], dict[str, bytes]] = {}


def write_objects(name: str, server: Any) -> dict[str, bytes]:
    """Write `objects(name)` to the store's server, and one object outside its prefix, once per
    server (the store's own test file and the shared suite read the same ones); return them."""
    if (name, server) not in _WRITTEN:
        bodies = objects(name)
        for key, body in bodies.items():
            server.put(key, body)
        server.put("elsewhere/x.bin", b"not listed")
        _WRITTEN[name, server] = bodies
    return _WRITTEN[name, server]


@dataclass
class Store:
    """One store's server and what sets it apart; `source()` makes a source over `prefix`."""

    name: str
    server: Any
    missing: str  # the error code a 404 names
    throttles: tuple[str, ...]  # the fault proxy's kinds for this store's "slow down" answers
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        self.prefix = PREFIXES[self.name]

    @property
    def bucket(self) -> str:
        return str(getattr(self.server, "container", None) or self.server.bucket)

    def url(self, path: str) -> str:
        scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[self.name]
        return f"{scheme}://{self.bucket}/{path}"

    def put(self, key: str, body: bytes) -> None:
        self.server.put(key, body)

    @property
    def upstream(self) -> str:
        """What a fault proxy in front of this store forwards to."""
        if self.name == "azure":
            return f"http://127.0.0.1:{self.server.port}"
        return str(self.server.endpoint)

    def options(self, endpoint: str | None = None) -> dict[str, Any]:
        """Credentials and endpoint for a source (the endpoint a proxy's URL, if given)."""
        if self.name == "s3":
            return {"endpoint_url": endpoint or self.server.endpoint,
                    "credentials": self.server.credentials}  # fmt: skip
        if self.name == "gcs":
            return {"endpoint_url": endpoint or self.server.endpoint, "anonymous": True}
        if endpoint:  # the proxy's Host: a connection string names the account's endpoint on it
            return {"connection_string": self.server.connection_string(f"{endpoint}/{ACCOUNT}")}
        return {"endpoint_url": self.server.endpoint, "account_name": ACCOUNT, "account_key": KEY}

    def source(
        self, keys: list[str] | None = None, *, prefix: str | None = None,
        endpoint: str | None = None, **options: Any,
    ) -> Any:  # fmt: skip
        """A source over `prefix` (the store's own by default), through `endpoint` if given."""
        make = {"s3": s3, "gcs": gcs, "azure": azure}[self.name]
        url = self.url(self.prefix if prefix is None else prefix)
        return make(url, keys, **self.options(endpoint), **options)

    def tar_options(self) -> dict[str, Any]:
        """`tar_shards`' keyword for this store's shards."""
        return {f"{self.name}_options": self.options()}


def make_store(name: str, server: SeaweedServer | GcsServer | AzuriteServer) -> Store:
    if name == "s3":
        return Store(name, server, missing="NoSuchKey", throttles=("slowdown",))
    if name == "gcs":
        return Store(name, server, missing="", throttles=("429", "503"))
    return Store(name, server, missing="BlobNotFound", throttles=("500-timed-out", "server-busy"))
