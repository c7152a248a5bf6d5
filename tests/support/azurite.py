"""A real Azure Blob endpoint for the tests: Azurite (npm's `azurite`, in .azurite/) on 127.0.0.1.

`start_azurite(dir)` starts `azurite-blob` on a free port (in memory, no telemetry, account taken
from the URL's path), waits until it answers, creates the container CONTAINER with the official SDK
and returns an `AzuriteServer` whose `blobs()` is that SDK's container client, to write objects.
Azurite checks SharedKey signatures, so a wrong key is refused. `make setup` installs it into
.azurite/ (`npm install azurite@3`); without node or azurite the tests that need it skip, saying so.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.serverprocs import free_port, start_logged, stop, wait_ready

__all__ = ["ACCOUNT", "CONTAINER", "KEY", "AzuriteServer", "find_azurite", "start_azurite"]

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is in tests/support/)
# Azurite's own development account: its name and key are published with the emulator.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "test-container"
START_DEADLINE_S = 30.0
# Between readiness probes: nothing signals that the server in another process is ready.
PROBE_INTERVAL_S = 0.1


def find_azurite() -> str | None:
    """`azurite-blob`: the project's .azurite/ install (make setup), else on PATH."""
    local = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


class AzuriteServer:
    """A running Azurite; `endpoint` is the account's blob endpoint (http://127.0.0.1:P/ACCOUNT)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.account = ACCOUNT
        self.key = KEY
        self.container = CONTAINER
        self.endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"

    def connection_string(self, endpoint: str | None = None, key: str = KEY) -> str:
        """A connection string for this server (or for `endpoint`, a proxy in front of it)."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint or self.endpoint};"
        )

    def service(self) -> Any:
        """The official SDK's BlobServiceClient for this server."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def blobs(self) -> Any:
        """The official SDK's ContainerClient for CONTAINER."""
        return self.service().get_container_client(self.container)

    def put(self, name: str, body: bytes) -> None:
        self.blobs().upload_blob(name, body, overwrite=True)

    def stop(self) -> None:
        stop(self.proc)


def start_azurite(workdir: Path, in_memory: bool = True) -> AzuriteServer:
    """Start Azurite (blobs kept in memory, or with `in_memory=False` in files under `workdir`; its
    log in `workdir`); skip if node or azurite is missing."""
    if shutil.which("node") is None:
        pytest.skip("Azure tests need node (for Azurite); none on PATH")
    exe = find_azurite()
    if exe is None:
        if (
            ROOT / ".azurite" / ".installed"
        ).exists():  # installed, and not found: a bug, not a skip
            raise RuntimeError(f"make setup installed Azurite in {ROOT / '.azurite'}, not found")
        pytest.skip("Azure tests need Azurite: `make setup` installs it into .azurite/")
    pytest.importorskip("azure.storage.blob", reason="pip install azure-storage-blob (dev extra)")
    port = free_port()
    cmd = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--disableTelemetry",
           "--disableProductStyleUrl", "--skipApiVersionCheck", "--loose", "--silent"]  # fmt: skip
    cmd += ["--inMemoryPersistence"] if in_memory else ["--location", str(workdir / "data")]
    log = workdir / "azurite.out"
    proc = start_logged(cmd, log, cwd=workdir)
    server = AzuriteServer(proc, port)

    def listening() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True

    wait_ready(proc, listening, "Azurite", log, START_DEADLINE_S, PROBE_INTERVAL_S)
    server.service().create_container(CONTAINER)
    return server


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    """One Azurite for the session (skips, saying why, when node or azurite is missing)."""
    server = start_azurite(tmp_path_factory.mktemp("azurite"))
    yield server
    server.stop()
