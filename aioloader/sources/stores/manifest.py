"""A listing written down once: the keys, sizes and ETags under a prefix, compact, shared by a job's ranks.

Listing a prefix costs one request per 1,000 keys; a job whose every rank lists it pays that many times
over, and a store that throttles its listing can stall the whole start. A `Manifest` is one listing
kept as arrays:

    b"AIOLMAN1"  u32 header length  header (JSON: where, count, key_bytes, etags)
    key offsets (u32, or u64 past 4 GiB of keys; count + 1)  key bytes (UTF-8)  sizes (i64)
    etags: 16 bytes each where every ETag is an MD5 hex digest, else offsets (u64) and text

about 28 bytes a key beside the key's own text. `python -m aioloader manifest URL -o FILE` writes one,
and a store source's `manifest=` reads it instead of listing. Without a file, when a torch.distributed
process group is up, `share_listing` has the first rank that asks list the prefix and hand the manifest
to the others through the job's key-value store, so a job lists once whatever its world size.
"""

from __future__ import annotations

import atexit
import itertools
import json
import mmap
import os
import re
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..._exceptions import FetchError
from ..._util.deps import c10d_default_store

__all__ = ["Manifest", "share_listing"]

MAGIC = b"AIOLMAN1"
_MD5 = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_SHARED_PREFIX = "aioloader/listing/"


@dataclass(frozen=True, eq=False)
class Manifest:
    """The objects under one prefix: `keys` in key order, their `sizes` and ETags ("" where none)."""

    where: str  # the prefix's URL, e.g. "s3://bucket/train/"
    keys: list[str]
    sizes: np.ndarray[Any, np.dtype[np.int64]]
    etags: list[str]

    @classmethod
    def of(
        cls, where: str, keys: Sequence[str], sizes: Sequence[int], etags: Sequence[str]
    ) -> Manifest:
        if not len(keys) == len(sizes) == len(etags):
            raise ValueError("keys, sizes and etags must be as long as each other")
        return cls(where, list(keys), np.asarray(sizes, dtype=np.int64), list(etags))

    def to_bytes(self) -> bytes:
        blob = "".join(self.keys).encode()
        lengths = [len(k.encode()) for k in self.keys]
        wide = len(blob) >= 1 << 32
        offsets = np.zeros(len(self.keys) + 1, dtype=np.uint64 if wide else np.uint32)
        np.cumsum(lengths, out=offsets[1:])
        digests = [_MD5.match(e) for e in self.etags]
        quoted = {e.startswith('"') for e in self.etags}
        md5 = all(digests) and len(quoted) <= 1
        kind = ("md5q" if quoted == {True} else "md5") if md5 else "text"
        header = {"where": self.where, "count": len(self.keys), "key_bytes": len(blob),
                  "wide": wide, "etags": kind}  # fmt: skip
        parts = [offsets.tobytes(), blob, self.sizes.astype("<i8").tobytes()]
        if md5:
            parts.append(b"".join(bytes.fromhex(d.group(1)) for d in digests if d))
        else:
            text = [e.encode() for e in self.etags]
            etag_offsets = np.zeros(len(text) + 1, dtype=np.uint64)
            np.cumsum([len(t) for t in text], out=etag_offsets[1:])
            parts += [etag_offsets.tobytes(), b"".join(text)]
        head = json.dumps(header).encode()
        return b"".join([MAGIC, struct.pack("<I", len(head)), head, *parts])

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, name: str = "manifest") -> Manifest:
        """The manifest in `data`; ValueError naming `name` when it is not one."""
        view = memoryview(data)
        try:
            if bytes(view[:8]) != MAGIC:
                raise ValueError("not an aioloader manifest")
            (n_head,) = struct.unpack_from("<I", view, 8)
            header = json.loads(bytes(view[12 : 12 + n_head]))
            count, n_keys = int(header["count"]), int(header["key_bytes"])
            pos = 12 + n_head
            width = 8 if header["wide"] else 4
            offsets = np.frombuffer(
                view, np.uint64 if header["wide"] else np.uint32, count + 1, pos
            )
            pos += width * (count + 1)
            text = bytes(view[pos : pos + n_keys]).decode()
            pos += n_keys
            sizes = np.frombuffer(view, "<i8", count, pos).astype(np.int64)
            pos += 8 * count
            etags = _etags(view, pos, count, header["etags"])
            keys = _split(text, offsets, n_keys)
        except (
            ValueError,
            KeyError,
            struct.error,
            UnicodeDecodeError,
            json.JSONDecodeError,
        ) as exc:
            raise ValueError(f"{name}: not a readable aioloader manifest ({exc})") from exc
        return cls(str(header["where"]), keys, sizes, etags)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write it to `path` atomically (a reader sees the old file or the whole new one)."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(target)
        return target

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest:
        """The manifest in file `path` (ValueError naming the file when it is not one)."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"manifest={str(path)!r}: cannot read it: {exc}") from exc
        return cls.from_bytes(data, f"manifest={str(path)!r}")


def _split(text: str, offsets: np.ndarray[Any, Any], n_bytes: int) -> list[str]:
    """The keys out of their concatenated text, by byte offsets (ASCII text: sliced as str)."""
    if int(offsets[-1]) != n_bytes:
        raise ValueError("key offsets do not match the key bytes")
    if len(text) == n_bytes:  # ASCII: byte offsets are character offsets
        bounds = offsets.tolist()
        return [text[a:b] for a, b in itertools.pairwise(bounds)]
    raw = text.encode()
    return [raw[a:b].decode() for a, b in itertools.pairwise(offsets.tolist())]


def _etags(view: memoryview, pos: int, count: int, kind: str) -> list[str]:
    if kind in ("md5", "md5q"):
        raw = bytes(view[pos : pos + 16 * count])
        if len(raw) != 16 * count:
            raise ValueError("truncated")
        q = '"' if kind == "md5q" else ""
        return [f"{q}{raw[i : i + 16].hex()}{q}" for i in range(0, len(raw), 16)]
    offsets = np.frombuffer(view, np.uint64, count + 1, pos)
    start = pos + 8 * (count + 1)
    text = bytes(view[start : start + int(offsets[-1])])
    return [text[a:b].decode() for a, b in itertools.pairwise(offsets.tolist())]


class KeyValueStore(Protocol):
    """What `share_listing` needs of torch.distributed's store (TCPStore, FileStore, ...)."""

    def add(self, key: str, amount: int) -> int: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def wait(self, keys: list[str]) -> None: ...


_asked: dict[tuple[int, str], int] = {}  # per store and prefix: listings asked of the job so far
_asked_lock = threading.Lock()


def job_store() -> KeyValueStore | None:
    """The key-value store of torch.distributed's default group when one is up with 2+ ranks."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    store: KeyValueStore | None = c10d_default_store()
    return store


def share_listing(
    where: str,
    list_here: Callable[[], Manifest],
    store: KeyValueStore | None = None,
    node: str | None = None,
) -> Manifest:
    """`list_here()` on the first rank of the job that asks for `where`; the others get its manifest.

    Ranks ask in the same order (each process counts its listings of `where` through its store), so
    the n-th listing of each rank is the same one; a rank that asks more often than the others lists
    those extra times itself rather than wait. Where no process group is up (and no `store` is
    given), it lists here. The manifest crosses the network once per node (`node`: this host's
    name): the first rank of a node to ask takes it from the store and writes it to a file of the
    node's temporary folder, which the node's other ranks map. A rank whose listing fails passes the
    error on: the others raise `FetchError` instead of waiting for it.
    """
    store = store if store is not None else job_store()
    if store is None:
        return list_here()
    with _asked_lock:
        n = _asked[id(store), where] = _asked.get((id(store), where), 0) + 1
    key = f"{_SHARED_PREFIX}{where}/{n}"
    if store.add(f"{key}/claim", 1) == 1:
        try:
            manifest = list_here()
        except BaseException as exc:
            store.set(f"{key}/data", b"E" + f"{type(exc).__name__}: {exc}".encode())
            raise
        store.set(f"{key}/data", b"M" + manifest.to_bytes())
        return manifest
    on_node = f"{key}/node/{node or socket.gethostname()}"
    if store.add(f"{on_node}/claim", 1) == 1:  # the node's first: from the store to a file
        store.wait([f"{key}/data"])
        data = store.get(f"{key}/data")
        if data[:1] == b"E":
            store.set(f"{on_node}/file", data)
            raise _failed(where, data)
        path = _node_file(data)
        store.set(f"{on_node}/file", b"F" + str(path).encode())
        return Manifest.from_bytes(memoryview(data)[1:], f"the job's listing of {where}")
    store.wait([f"{on_node}/file"])
    answer = store.get(f"{on_node}/file")
    if answer[:1] == b"E":
        raise _failed(where, answer)
    path = Path(answer[1:].decode())
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return Manifest.from_bytes(memoryview(mapped)[1:], f"the job's listing of {where} ({path})")


def _failed(where: str, data: bytes) -> FetchError:
    return FetchError(
        f"listing of {where} failed on the rank that listed it for the job: "
        f"{data[1:].decode(errors='replace')}",
        key=where,
    )


def _node_file(data: bytes) -> Path:
    """`data` in a new file of this node's temporary folder, removed when this process exits."""
    folder = Path(tempfile.gettempdir(), "aioloader-manifests")
    folder.mkdir(exist_ok=True)
    fd, name = tempfile.mkstemp(suffix=".manifest", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    atexit.register(_remove, Path(name))
    return Path(name)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
