"""One listing per job: the manifest format, `manifest=`, the CLI, and ranks that share one listing.

The store is a real SeaweedFS server behind the fault proxy, which counts the requests per path: a
ListObjectsV2 request is a GET of the bucket's own path.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from support.faultproxy import FaultProxy
from support.s3server import SeaweedServer

from aioloader import FetchError
from aioloader.sources import Manifest, s3
from aioloader.sources.stores.keyspace import PARTS
from aioloader.sources.stores.manifest import share_listing

PREFIX = "manifest/"
N_OBJECTS = 45
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.fixture(scope="module")
def stored(seaweed: SeaweedServer) -> dict[str, bytes]:
    rng = random.Random(11)
    objects = {f"{PREFIX}{i:03d}.bin": rng.randbytes(100 + i) for i in range(N_OBJECTS)}
    objects[f"{PREFIX}ü dir/ä.bin"] = b"unicode key"
    for name, body in objects.items():
        seaweed.put(name, body)
    return objects


@pytest.fixture
def counted(seaweed: SeaweedServer, stored: dict[str, bytes]) -> FaultProxy:
    proxy = FaultProxy(seaweed.endpoint)
    yield proxy
    proxy.stop()


def lists(proxy: FaultProxy, server: SeaweedServer) -> int:
    """ListObjectsV2 requests the proxy has seen (GETs of the bucket itself)."""
    return proxy.seen[server.bucket] + proxy.seen[f"{server.bucket}/"]


def one_listing(n: int) -> int:
    """The most requests one listing of `n` keys in pages of 10 makes: a request a page, and at
    most one more per part of the key space listed at once (`stores/keyspace.py`)."""
    return math.ceil(n / 10) + PARTS


def source(server: SeaweedServer, endpoint: str, **options: object) -> object:
    return s3(
        f"s3://{server.bucket}/{PREFIX}", endpoint_url=endpoint,
        credentials=server.credentials, page_size=10, **options,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.text(min_size=1, max_size=12), max_size=30, unique=True),
    md5=st.booleans(),
    quoted=st.booleans(),
)
def test_a_manifest_reads_back_what_was_written(keys: list[str], md5: bool, quoted: bool) -> None:
    rng = random.Random(len(keys))
    q = '"' if quoted else ""
    etags = [
        f"{q}{rng.randbytes(16).hex()}{q}" if md5 else f"W/{k}-{i}" for i, k in enumerate(keys)
    ]
    sizes = [rng.randrange(1 << 40) for _ in keys]
    made = Manifest.of("s3://b/p/", keys, sizes, etags)
    back = Manifest.from_bytes(made.to_bytes())
    assert (back.where, back.keys, back.sizes.tolist(), back.etags) == (
        "s3://b/p/",
        keys,
        sizes,
        etags,
    )


def test_md5_etags_take_16_bytes(tmp_path: Path) -> None:
    keys = [f"k{i:06d}" for i in range(1000)]
    etags = [f'"{random.Random(i).randbytes(16).hex()}"' for i in range(1000)]
    path = Manifest.of("s3://b/", keys, [1] * 1000, etags).write(tmp_path / "m")
    per_key = (path.stat().st_size - len("".join(keys))) / 1000
    assert per_key < 30  # 4 (offset) + 8 (size) + 16 (MD5), and a header
    assert Manifest.read(path).etags == etags


def test_a_file_that_is_not_a_manifest_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a manifest at all")
    with pytest.raises(ValueError, match=r"manifest='.*bad\.bin'"):
        Manifest.read(bad)
    good = Manifest.of("s3://b/", ["a", "b"], [1, 2], ["", ""]).to_bytes()
    (tmp_path / "cut").write_bytes(good[:-5])
    with pytest.raises(ValueError, match="not a readable aioloader manifest"):
        Manifest.read(tmp_path / "cut")
    with pytest.raises(ValueError, match="cannot read it"):
        Manifest.read(tmp_path / "absent")


def test_a_source_with_a_manifest_never_lists(
    seaweed: SeaweedServer, stored: dict[str, bytes], counted: FaultProxy, tmp_path: Path
) -> None:
    listed = source(seaweed, counted.url)
    manifest = listed.manifest()
    expected = sorted(stored, key=str.encode)
    assert manifest.keys == expected
    assert lists(counted, seaweed) <= one_listing(len(stored))
    path = manifest.write(tmp_path / "train.manifest")
    counted.reset_counts()
    src = source(seaweed, counted.url, manifest=path)
    assert src.keys() == expected
    assert {k: src.size(k) for k in expected} == {k: len(v) for k, v in stored.items()}
    assert src.etag(expected[0]) == manifest.etags[0] != ""
    assert lists(counted, seaweed) == 0


def test_the_rank_that_lists_takes_sizes_and_etags_once_from_its_manifest(
    seaweed: SeaweedServer, stored: dict[str, bytes], counted: FaultProxy
) -> None:
    """Listing writes the manifest's arrays only; `keys()` takes the sizes and ETags from it, once
    (not a second time from the listing itself: at 10 M keys each pass costs seconds)."""
    listed: Any = source(seaweed, counted.url)
    manifest = listed.manifest()
    first = manifest.keys[0]
    assert (listed.size(first), listed.etag(first)) == (None, None)  # the source is as it was
    assert listed.keys() == manifest.keys
    assert listed.size(first) == len(stored[first])
    assert listed.etag(first) == manifest.etags[0] != ""
    assert len(listed.listing._sizes) == len(listed.listing._etags) == len(stored)


def test_a_manifest_of_another_prefix_or_with_keys_is_refused(
    seaweed: SeaweedServer, stored: dict[str, bytes]
) -> None:
    other = Manifest.of(f"s3://{seaweed.bucket}/elsewhere/", ["elsewhere/a"], [1], [""])
    with pytest.raises(ValueError, match=r"manifest: it lists s3://.*/elsewhere/"):
        source(seaweed, seaweed.endpoint, manifest=other)
    with pytest.raises(ValueError, match="keys and manifest"):
        s3(f"s3://{seaweed.bucket}/{PREFIX}", ["a"], manifest=other, endpoint_url=seaweed.endpoint)


def test_the_command_line_writes_a_manifest(
    seaweed: SeaweedServer, stored: dict[str, bytes], tmp_path: Path
) -> None:
    out = tmp_path / "cli.manifest"
    access, secret = seaweed.credentials
    env = dict(os.environ, AWS_ACCESS_KEY_ID=access, AWS_SECRET_ACCESS_KEY=secret)
    done = subprocess.run(
        [sys.executable, "-m", "aioloader", "manifest", f"s3://{seaweed.bucket}/{PREFIX}",
         "--endpoint-url", seaweed.endpoint, "-o", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{len(stored)} objects" in done.stdout
    assert Manifest.read(out).keys == sorted(stored, key=str.encode)
    bad = subprocess.run(
        [sys.executable, "-m", "aioloader", "manifest", "ftp://x/y", "-o", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "s3://, gs:// or az://" in bad.stdout


class Counted:
    """A rank's store client that counts the values it takes from the store, by key."""

    def __init__(self, store: dist.Store, gets: collections.Counter[str]) -> None:
        self.store, self.gets = store, gets

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self.gets[key.rsplit("/", 1)[-1]] += 1
        return bytes(self.store.get(key))

    def wait(self, keys: list[str]) -> None:
        self.store.wait(keys)


@pytest.mark.parametrize("nodes", [1, 2])
def test_ranks_that_share_a_store_list_once_and_fetch_once_per_node(nodes: int) -> None:
    """Eight ranks' clients of one TCPStore: the first lists, the first of each node takes the
    manifest from the store, the node's others map the file it wrote."""
    master = dist.TCPStore("127.0.0.1", 0, 8, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", master.port, 8, is_master=False) for _ in range(7)]
    gets: collections.Counter[str] = collections.Counter()
    calls: list[int] = []
    made = Manifest.of("s3://b/p/", ["p/a", "p/b"], [3, 4], ['"x"', ""])
    got: dict[int, Manifest] = {}
    errors: list[BaseException] = []

    def rank(i: int, store: Counted) -> None:
        def list_here() -> Manifest:
            calls.append(i)
            return made

        try:
            where = f"s3://b/p{nodes}/"  # each test its own: a process counts its listings
            got[i] = share_listing(where, list_here, store, f"n{i % nodes}")
        except BaseException as exc:
            errors.append(exc)

    stores = [Counted(s, gets) for s in [master, *clients]]  # alive: one per rank, as in a job
    threads = [threading.Thread(target=rank, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(calls) == 1
    assert sorted(got) == list(range(8))
    assert all(m.keys == made.keys and m.etags == made.etags for m in got.values())
    assert all(m.sizes.tolist() == [3, 4] for m in got.values())
    assert gets["data"] == nodes  # the manifest left the store once per node
    assert gets["file"] == 8 - 1 - nodes  # the others read the node's file


def test_a_failed_listing_reaches_every_rank_as_an_error() -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 2, is_master=False)

    def fail() -> Manifest:
        raise FetchError("listing of s3://b/q/ failed: AccessDenied", key="s3://b/q/")

    with pytest.raises(FetchError, match="AccessDenied"):
        share_listing("s3://b/q/", fail, master)
    with pytest.raises(FetchError, match=r"failed on the rank that listed it.*AccessDenied"):
        share_listing("s3://b/q/", lambda: pytest.fail("the second rank listed"), client)


def test_torchrun_four_ranks_list_the_prefix_once(
    seaweed: SeaweedServer, stored: dict[str, bytes], counted: FaultProxy, tmp_path: Path
) -> None:
    access, secret = seaweed.credentials
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node=4", str(SCRIPTS / "list_once.py"),
           str(tmp_path), counted.url, f"s3://{seaweed.bucket}/{PREFIX}", access, secret]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, timeout=240, capture_output=True, text=True)
    records = [tmp_path / f"rank{r}.json" for r in range(4)]
    assert all(p.exists() for p in records), done.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in records]
    expected = sorted(stored, key=str.encode)
    assert all(r["keys"] == expected for r in ranks)
    assert all(r["sizes"] == [len(stored[k]) for k in expected] for r in ranks)
    assert len({json.dumps(r["etags"]) for r in ranks}) == 1
    assert lists(counted, seaweed) <= one_listing(len(stored))  # once for the job, not per rank
    assert np.all(np.asarray(ranks[0]["sizes"]) > 0)
