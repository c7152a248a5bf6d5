"""Security: private shared memory, no unpickling of remote bytes, no credentials in logs or errors.

- Shared-memory slabs are created 0600 whatever the umask, O_EXCL and O_NOFOLLOW (a planted file or
  symlink at the name is refused, never written through), with 96 random bits in the name, and
  unlinked at once: the only ways in are the parent's descriptors and the workers' mappings.
- Bytes from a remote source are never unpickled by the loader (HTTP objects, tar members named
  .pyd/.pickle/.pth), whatever the executor: a payload whose unpickling would create a file comes
  back byte for byte, and no file appears.
- Across whole failing authenticated runs (retries, resets, truncated bodies, stalls, tar shards
  resumed over HTTP), no secret of the URLs (the userinfo, its Basic-auth form, token and signature
  query values) reaches any log record at DEBUG of any logger, the text of the raised error (its
  notes, causes and traceback), the stats, the diagnosis or a repr.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import pickle
import re
import secrets
import stat
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from aiohttp import web
from scripts.tarcraft import END, member
from support.faultproxy import Fault, FaultProxy, Origin, ServerThread

from aioloader import FetchError, Loader, ProcessExecutor
from aioloader._executors.process.arena import SLAB_LINKS, Arena
from aioloader.sources import http, tar_shards
from aioloader.sources.transport.redact import redact_url

WAIT_S = 30.0
SLAB_NAME = re.compile(r"^(?:/memfd:|/dev/shm/)aioloader-(\d+)-([0-9a-f]{24}) \(deleted\)$")


def _slab_line(line: str) -> bool:
    """Whether a line of /proc/PID/maps maps a slab."""
    fields = line.split(maxsplit=5)
    return len(fields) > 5 and fields[5].startswith(SLAB_LINKS)


def make_tensor(n: int) -> torch.Tensor:
    """Decoded in a worker: the result comes back in a shared-memory slot."""
    return torch.full((n,), 1.0)


def slab_fds() -> dict[int, str]:
    """This process's descriptors of shared-memory slabs, and their link text."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith(SLAB_LINKS):
                out[int(name)] = target
    return out


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def test_slabs_are_private_unguessable_and_unlinked() -> None:
    with umask(0), ProcessExecutor(1) as executor:  # the most permissive umask there is
        executor.wait_ready(WAIT_S)
        # two size classes: two slabs
        kept = [executor.submit(make_tensor, n).result(WAIT_S) for n in (10, 300_000)]
        fds = slab_fds()  # each slab: its one descriptor
        names = set()
        for fd, target in fds.items():
            match = SLAB_NAME.match(target)
            assert match, target
            assert int(match.group(1)) == os.getpid()
            names.add(match.group(2))
            st = os.fstat(fd)
            assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
            assert st.st_uid == os.getuid()
            assert st.st_nlink == 0  # unlinked: nobody can open it by name
        assert len(names) >= 2  # two slabs, each its own random name
        assert [
            n for n in os.listdir("/dev/shm") if n.startswith(f"aioloader-{os.getpid()}-")
        ] == []
        (worker,) = executor.pids
        maps = Path(f"/proc/{worker}/maps").read_text().splitlines()
        mapped = {line.split(maxsplit=5)[5] for line in maps if _slab_line(line)}
        # the worker maps what it was handed (and what it inherited at fork), nothing else: every
        # slab it maps is one this process maps too (a slab no longer needs a descriptor for that)
        ours = {line.split(maxsplit=5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
                if _slab_line(line)}  # fmt: skip
        assert set(fds.values()) <= ours
        assert mapped <= ours
        assert all(line.split()[1].endswith("s") for line in maps if _slab_line(line))
        links = [os.readlink(f"/proc/{worker}/fd/{n}") for n in os.listdir(f"/proc/{worker}/fd")]
        assert {t for t in links if t.startswith(SLAB_LINKS)} <= set(fds.values())
        del kept


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_slab_name_taken_in_advance_is_refused_not_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    guess = "0" * 24
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: guess)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = tmp_path / f"aioloader-{os.getpid()}-{guess}"
    if planted == "symlink":
        name.symlink_to(victim)
    else:
        name.write_bytes(b"not yours")
    arena = Arena(1 << 20, directory=str(tmp_path))
    try:
        assert arena.acquire(1000) is None  # refused: the caller falls back to ordinary memory
    finally:
        arena.close()
    assert victim.read_bytes() == b"precious"
    assert name.is_symlink() == (planted == "symlink")
    if planted == "file":
        assert name.read_bytes() == b"not yours"


def test_slab_names_do_not_repeat() -> None:
    seen = set()
    before = set(slab_fds().values())  # other tests' slabs still viewed by something
    for _ in range(20):
        arena = Arena(1 << 20)
        try:
            slot = arena.acquire(1000)
            assert slot is not None
            (target,) = set(slab_fds().values()) - before
            seen.add(target)
            arena.release(slot)
            del slot
        finally:
            arena.close()
    assert len(seen) == 20


# -- remote bytes are never unpickled ----------------------------------------------------------------


class Payload:
    """Unpickling this creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def as_bytes(raw: bytes) -> bytes:
    """A decode that keeps the raw bytes (module level: process workers import it)."""
    return bytes(raw)


@pytest.fixture
def evil(tmp_path: Path) -> Iterator[tuple[Origin, Path, dict[str, bytes]]]:
    marker = tmp_path / "unpickled"
    blob = pickle.dumps(Payload(marker))
    with pytest.raises(FileNotFoundError):  # the test's own check that the payload is live
        pickle.loads(pickle.dumps(Payload(tmp_path / "missing-dir" / "x")))
    objects = {
        "small.pkl": blob,
        "large.pkl": blob + bytes(200_000),  # past the pipe's inline limit: shared memory
        "tensor.pt": blob,
    }
    shard = b"".join(member(f"s.{ext}".encode(), blob) for ext in ("pyd", "pickle", "pth", "pkl"))
    objects["shard.tar"] = shard + END
    origin = Origin(objects)
    yield origin, marker, objects
    origin.stop()


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_remote_bytes_are_never_unpickled(
    evil: tuple[Origin, Path, dict[str, bytes]], executor: str
) -> None:
    origin, marker, objects = evil
    keys = ["small.pkl", "large.pkl", "tensor.pt"]
    for decode in (None, as_bytes):
        src = http(origin.url + "/", keys, attempts=1)
        with Loader(src, decode=decode, executor=executor, workers=1, collate=None) as loader:
            got = list(loader)
        assert [bytes(x) for x in got] == [objects[k] for k in keys]
        assert all(isinstance(x, bytes | bytearray) for x in got)
    with Loader(tar_shards([origin.url + "/shard.tar"]), collate=None) as loader:
        (sample,) = list(loader)
    for ext in ("pyd", "pickle", "pth", "pkl"):
        assert sample[ext] == objects["small.pkl"]
    assert not marker.exists()


# -- credentials never reach logs or errors ----------------------------------------------------------

USER, PASSWORD = "alice", "hunter2pass"
TOKEN, SIG = "TOKENqwerty9", "SIGabc123xyz"
CUSTOM = "CUSTOMauth7781"  # the value of a parameter whose name no list of secrets holds
SECRETS = [
    PASSWORD, TOKEN, SIG, CUSTOM, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
]  # fmt: skip


class Everything(logging.Handler):
    """Every record of every logger, formatted with its exception and stack."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(self.format(record) + " " + repr(record.args))


@pytest.fixture
def everything() -> Iterator[Everything]:
    root = logging.getLogger()
    handler = Everything()
    levels = {
        name: logging.getLogger(name).level for name in ("", "aioloader", "aiohttp", "asyncio")
    }
    root.addHandler(handler)
    for name in levels:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def authenticated(url: str) -> str:
    """`url` with the userinfo and the secret query parameters."""
    scheme, rest = url.split("://", 1)
    return (
        f"{scheme}://{USER}:{PASSWORD}@{rest}?token={TOKEN}&sig={SIG}&X-Custom-Auth={CUSTOM}&page=2"
    )


def error_texts(err: BaseException) -> list[str]:
    """What a consumer shows of an error: its traceback (notes and causes included) and repr."""
    return ["".join(traceback.format_exception(err)), repr(err), *getattr(err, "__notes__", [])]


def loader_texts(loader: Loader[Any]) -> list[str]:
    return [repr(loader.stats()), str(loader.diagnose()), repr(loader.stats().skipped)]


def assert_no_secret(texts: list[str]) -> None:
    for secret in SECRETS:
        leaked = [t for t in texts if secret in t]
        assert not leaked, f"{secret!r} shown in: {leaked[0][:500]}"


ALWAYS = {"obj/00000.bin": "500", "obj/00005.bin": "truncate", "obj/00010.bin": "reset"}


def faults(path: str, n: int) -> Fault | None:
    """Three objects always fail, each its own way; one stalls twice (the read timeout ends each
    attempt); every other object answers 503 once."""
    if path in ALWAYS:
        return Fault(ALWAYS[path])
    if path == "obj/00003.bin":
        return Fault("stall", 5.0) if n <= 2 else None
    return Fault("503") if n == 1 else None


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
def test_no_secret_in_logs_or_errors_of_a_failing_authenticated_run(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes], everything: Everything
) -> None:
    proxy.plan = faults
    names = list(objects)[:12]
    base = authenticated(proxy.url + "/")
    options = dict(attempts=3, backoff=0.001, max_backoff=0.01, read_timeout=0.3, engine=engine)
    texts: list[str] = []
    # base URL with keys, skipping what fails: the skip reasons are recorded
    src = http(base, names, **options)
    with Loader(src, collate=None, on_error="skip", max_skipped=None, concurrency=6) as loader:
        delivered = list(loader)
        texts += [*loader_texts(loader), repr(src), repr(src.keys())]
    assert len(delivered) == len(names) - len(ALWAYS)
    assert sorted(key for key, _ in loader.stats().skipped) == sorted(ALWAYS)
    assert proxy.injected["503"] > 0
    # whole URLs with their secrets, raising what fails
    urls = [authenticated(f"{proxy.url}/{name}") for name in names]
    src = http(urls, **options)
    with Loader(src, collate=None, concurrency=6) as loader, pytest.raises(FetchError) as info:
        list(loader)
    texts += error_texts(info.value) + loader_texts(loader) + [repr(src), repr(src.keys())]
    assert "REDACTED" in str(info.value)
    texts += everything.texts
    assert any("retrying" in t for t in everything.texts)  # the DEBUG records were captured
    assert_no_secret(texts)


def fail_a_tar_shard_over_http(proxy: FaultProxy, origin: Origin) -> tuple[FetchError, list[str]]:
    """Read a shard whose every response is reset mid-body, with an authenticated URL; the error,
    and what the loader shows of it (the error's text, its stats and diagnosis)."""
    blob = b"".join(member(f"s{i}.bin".encode(), bytes([i]) * 3000) for i in range(20)) + END
    origin.objects["shard.tar"] = blob
    proxy.plan = lambda path, n: Fault("reset-mid-body") if path.endswith(".tar") else None
    shard = authenticated(proxy.url + "/shard.tar")
    source = tar_shards([shard], http_options=dict(attempts=3, backoff=0.001, max_backoff=0.01))
    with Loader(source, collate=None) as loader, pytest.raises(FetchError) as info:
        list(loader)
    return info.value, [*error_texts(info.value), *loader_texts(loader), repr(source)]


def test_no_secret_in_logs_or_errors_of_a_failing_tar_shard_over_http(
    proxy: FaultProxy, origin: Origin, everything: Everything
) -> None:
    err, texts = fail_a_tar_shard_over_http(proxy, origin)
    assert "stream broke 3 times" in str(err)
    assert any("resuming" in t for t in everything.texts)
    assert_no_secret(texts + everything.texts)


def test_the_key_of_a_failed_remote_shard_is_redacted(proxy: FaultProxy, origin: Origin) -> None:
    err, _ = fail_a_tar_shard_over_http(proxy, origin)
    assert_no_secret([str(err.key)])


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
def test_the_secrets_checked_are_really_sent(engine: str) -> None:
    # the checks above are only as good as their secrets: each really goes out on the wire
    seen: list[str] = []

    async def spy(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", "") + " " + request.path_qs)
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_get("/{name:.*}", spy)
    server = ServerThread(app, "test-spy")
    try:
        src = http(authenticated(server.url + "/"), ["a.bin"], engine=engine)
        with Loader(src, collate=None) as loader:
            assert [bytes(x) for x in loader] == [b"ok"]
    finally:
        server.stop()
    (request,) = seen
    assert all(secret in request for secret in SECRETS[1:]), request  # the password, as Basic
    assert "page=2" in redact_url(authenticated(server.url + "/"))  # a harmless one is shown


def test_process_decode_sees_only_bytes_of_a_remote_pickle(
    evil: tuple[Origin, Path, dict[str, bytes]],
) -> None:
    origin, marker, objects = evil
    with ProcessExecutor(1) as executor:
        src = http(origin.url + "/", ["large.pkl"], attempts=1)
        with Loader(src, decode=as_bytes, executor=executor, collate=None) as loader:
            (got,) = list(loader)
        assert executor.stats().get("inputs_in_shm", 0) >= 1  # it went through shared memory
    assert got == objects["large.pkl"]
    assert not marker.exists()
    assert [p for p in executor.pids if psutil.pid_exists(p)] == [] or all(
        psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in executor.pids
    )
