"""Read a folder through the files source where one file may not be read (permission denied).

Usage: denied_read.py ROOT DENIED_KEY

Root bypasses permission bits (CAP_DAC_OVERRIDE), so this process first drops CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH from its capability sets (before any thread starts: threads inherit them), then
checks that reading DENIED_KEY really fails. Prints one JSON line:
  {"skip": reason}  when the read cannot be denied here, else
  {"raise": {"type", "notes", "key_named"}, "skip_policy": {"delivered", "skipped"}, "threads"}
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import sys
import threading
from pathlib import Path
from typing import Any

_CAP_VERSION_3 = 0x20080522
_DAC_CAPS = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_dac_capabilities() -> str | None:
    """Drop the two capabilities that bypass permission bits; None, or why it could not."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = _Header(_CAP_VERSION_3, 0)
    data = (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return f"capget failed (errno {ctypes.get_errno()})"
    keep = ~_DAC_CAPS & 0xFFFFFFFF
    data[0].effective &= keep
    data[0].permitted &= keep
    data[0].inheritable &= keep
    if libc.capset(ctypes.byref(header), data) != 0:
        return f"capset failed (errno {ctypes.get_errno()})"
    return None


def main(root: Path, denied: str) -> dict[str, Any]:
    why = drop_dac_capabilities()
    try:
        (root / denied).read_bytes()
    except PermissionError:
        pass
    else:
        return {"skip": f"reading a mode-000 file is not denied here ({why or 'capabilities'})"}

    from leakcheck import settle

    import aioloader
    from aioloader.sources import files

    out: dict[str, Any] = {}
    with aioloader.Loader(files(root), collate=None, concurrency=4) as loader:
        try:
            list(loader)
        except PermissionError as exc:
            notes = getattr(exc, "__notes__", [])
            out["raise"] = {"type": type(exc).__name__, "notes": notes,
                            "key_named": any(repr(denied) in n for n in notes)}  # fmt: skip

    async def skipping() -> dict[str, Any]:
        source = files(root)
        async with aioloader.Loader(source, on_error="skip", max_skipped=1) as loader:
            delivered = [bytes(x) async for x in loader]
            return {"delivered": [d.decode() for d in delivered], "skipped": loader.stats().skipped}

    out["skip_policy"] = asyncio.run(skipping())
    settle()
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("aioloader"))
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2])))
