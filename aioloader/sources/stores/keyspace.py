"""A prefix listed in parts at once: its key space cut at keys of our own making, joined in key order.

A listing answers one page (up to 1,000 keys) per request, and each page names the next, so a serial
listing of 10 M keys is 10,000 requests one after the other. A store can start a listing at any key,
though: S3's StartAfter (the keys after a given one), GCS's startOffset and endOffset (the keys in a
range). `list_parts` lists the first page as usual; when there is more, it cuts the rest of the key
space into parts and lists them at once, `width` pages in flight. Each part's bounds are checked here
on every key, whatever the store did with them, so the parts joined in key order are exactly the
serial listing.

Where to cut needs no prior knowledge of the keys. The first page's keys give an alphabet (the
characters after the prefix that keys use) and a width: reading a key as a number written in that
alphabet, how much of the key space a page covers. The space after the first page is cut into parts
of 1, 2, 4, ... pages' width, the last one open-ended, so that numbered (dense) keys and hashed
(spread) keys are both covered in a few cuts. Then, whenever a slot is free and no part waits, the
part with the most left to list (by its last page's width) is cut in two at the middle of what it
has left, so that no part stays much longer than the others; a part with less than four pages
left is not cut. A wrong estimate costs requests (an empty part costs one), never keys.

Requests: one per page, plus at most one per part (the page where a part passes its end), so about
keys / 1,000 + the number of parts. Azure's List Blobs has only an opaque marker, which cannot start
a listing at a key: its sources list serially (`width=1`, which never cuts).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..._exceptions import FetchError

__all__ = ["PARTS", "Objects", "Page", "PageAt", "list_parts"]

PARTS = 8  # pages in flight while one listing runs
_LEAST_TO_CUT = 4  # pages a part must have left to be cut in two (each cut costs about a request)
_SPARE_DIGITS = 2  # digits past the first page's longest key: room to cut between close keys


class PageAt(NamedTuple):
    """What a store's page function is asked for: the page after `token` (None: the first page of a
    listing that starts after key `after`, None: at the prefix's start) up to key `until` (None: to
    the end; a hint the store may ignore)."""

    token: str | None
    after: str | None
    until: str | None


class Page(NamedTuple):
    """One page of a listing."""

    objects: list[tuple[str, int]]  # (key, size), in any order
    etags: dict[str, str]
    next_token: str | None  # None: the last page


PageFn = Callable[[PageAt], Awaitable[Page]]


@dataclass
class Objects:
    """A listing: keys in key order, their sizes and ETags ("" where none); what it cost."""

    keys: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    etags: list[str] = field(default_factory=list)
    requests: int = 0
    cuts: list[str] = field(default_factory=list)  # the keys the key space was cut after
    empty: int = 0  # parts that held no key


@dataclass(eq=False)
class _Part:
    """The keys after `after` up to `until` (None: unbounded), listed page by page."""

    after: str | None
    until: str | None
    found: Objects = field(default_factory=Objects)
    token: str | None = None
    done: bool = False
    per_key: float = 0.0  # key space per key on its last page (0: no page yet)

    @property
    def position(self) -> str | None:
        """The last key listed so far (or where the part starts)."""
        return self.found.keys[-1] if self.found.keys else self.after


class _Space:
    """Keys after `prefix` read as numbers of `depth` digits in `alphabet` (monotone: a key after
    another is never a smaller number), and numbers written back as keys."""

    def __init__(self, prefix: str, keys: list[str]) -> None:
        self.prefix = prefix
        tails = [k[len(prefix) :] for k in keys]
        self.alphabet = sorted({c for tail in tails for c in tail}) or ["0"]
        self.depth = max(map(len, tails), default=0) + _SPARE_DIGITS
        self.base = len(self.alphabet)
        self.top = self.base**self.depth  # past every key of `depth` digits

    def number(self, key: str) -> int:
        """`key` as a number: a character outside the alphabet counts as the next one in it and
        ends the number (the digits after it are the smallest), or, past the whole alphabet, as
        the largest with every digit after it the largest too."""
        value, rest = 0, 0
        tail = key[len(self.prefix) : len(self.prefix) + self.depth]
        for i, char in enumerate(tail):
            digit = bisect.bisect_left(self.alphabet, char)
            if digit == self.base:
                value, rest = value * self.base + self.base - 1, self.base - 1
                return _fill(value, rest, self.base, self.depth - i - 1)
            value = value * self.base + digit
            if self.alphabet[digit] != char:
                return _fill(value, 0, self.base, self.depth - i - 1)
        return _fill(value, rest, self.base, self.depth - len(tail))

    def key(self, number: int) -> str:
        digits = []
        for _ in range(self.depth):
            number, digit = divmod(number, self.base)
            digits.append(self.alphabet[digit])
        return self.prefix + "".join(reversed(digits)).rstrip(self.alphabet[0])


def _fill(value: int, digit: int, base: int, count: int) -> int:
    """`value` followed by `count` more digits `digit`."""
    for _ in range(count):
        value = value * base + digit
    return value


async def list_parts(page: PageFn, prefix: str, where: str, width: int = PARTS) -> Objects:
    """Every object under `prefix`, listed with up to `width` pages in flight (1: serially).

    `page(PageAt(...))` fetches one page; `where` names the prefix in errors. Raises what `page`
    raises, and `FetchError` when a page is out of key order. Safe to cancel: the pages in flight
    are cancelled and awaited.
    """
    first = _Part(None, None)
    found = Objects()
    await _step(page, first, where, found)
    parts = [first]
    if first.done or width < 2 or not first.found.keys:  # (no key yet: nothing to cut by)
        while not first.done:
            await _step(page, first, where, found)
        return _join(parts, found)
    space = _Space(prefix, first.found.keys)
    first.per_key = _per_key(space, first.found.keys)
    page_keys = max(1, len(first.found.keys))
    parts = _spread(first, space, page_keys, width - 1, found)
    running: dict[asyncio.Task[None], _Part] = {}
    try:
        while True:
            while len(running) < width:
                busy = set(running.values())
                part = next((p for p in parts if not p.done and p not in busy), None)
                part = part or _cut(parts, space, page_keys, found)
                if part is None:
                    break
                running[asyncio.create_task(_step(page, part, where, found, space))] = part
            if not running:
                return _join(parts, found)
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del running[task]
                task.result()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _step(
    page: PageFn, part: _Part, where: str, found: Objects, space: _Space | None = None
) -> None:
    """List `part`'s next page, keeping the keys within its bounds (read after the page came:
    a cut meanwhile may have moved its end)."""
    answer = await page(PageAt(part.token, part.after, part.until))
    found.requests += 1
    got = part.found
    kept_before = len(got.keys)
    last = part.position
    for key, size in sorted(answer.objects):
        if key.endswith("/") and size == 0:
            continue  # a "folder" marker
        if part.after is not None and key <= part.after:
            continue  # a store that starts at its bound, not after it (or ignores it)
        if part.until is not None and key > part.until:
            part.done = True  # the next part's key
            break
        if last is not None and key <= last:
            raise FetchError(f"listing of {where} out of key order at {key!r}", key=where)
        last = key
        got.keys.append(key)
        got.sizes.append(size)
        got.etags.append(answer.etags.get(key, ""))
    part.token = answer.next_token
    part.done = part.done or answer.next_token is None
    new = got.keys[kept_before:]
    if space is not None and len(new) > 1:
        part.per_key = _per_key(space, new)
    if part.done and not got.keys:
        found.empty += 1


def _per_key(space: _Space, keys: list[str]) -> float:
    """The key space per key that `keys` (one page, in order) cover."""
    if len(keys) < 2:
        return 1.0
    return max(1.0, (space.number(keys[-1]) - space.number(keys[0])) / (len(keys) - 1))


def _spread(first: _Part, space: _Space, page_keys: int, count: int, found: Objects) -> list[_Part]:
    """The space after `first`'s first page cut into `count` more parts, of 1, 2, 4, ... pages'
    width (as that page's keys were spread), the last one open-ended."""
    parts = [first]
    at = space.number(first.found.keys[-1])
    step = first.per_key * page_keys
    for _ in range(count):
        at += int(step)
        step *= 2
        if at >= space.top:
            break
        cut = space.key(at)
        tail = parts[-1]
        if tail.position is None or cut <= tail.position:
            continue
        tail.until = cut
        parts.append(_Part(cut, None, per_key=first.per_key))
        found.cuts.append(cut)
    return parts


def _cut(parts: list[_Part], space: _Space, page_keys: int, found: Objects) -> _Part | None:
    """Cut the part with the most left to list in two; the new part (its second half), or None
    when no part has `_LEAST_TO_CUT` pages' worth left. Only a part that has listed a page is
    cut: what is left of it is estimated from that page."""
    best: tuple[float, int, str] | None = None
    for i, part in enumerate(parts):
        position = part.position
        if part.done or not part.found.keys or position is None:
            continue
        at = space.number(position)
        per_key = part.per_key or parts[0].per_key
        if part.until is None:  # open-ended: 1, 2, 4, ... pages' width, up to half of what is left
            step = min(per_key * page_keys * 2 ** len(found.cuts), (space.top - at) / 2)
            left = float("inf")
        else:
            step = (space.number(part.until) - at) / 2
            left = 2 * step / per_key
        if left < _LEAST_TO_CUT * page_keys or step < 1:
            continue
        cut = space.key(at + int(step))
        if cut <= position or (part.until is not None and cut >= part.until):
            continue
        if best is None or left > best[0]:
            best = (left, i, cut)
    if best is None:
        return None
    _, i, cut = best
    old = parts[i]
    new = _Part(cut, old.until, per_key=old.per_key)
    old.until = cut
    parts.insert(i + 1, new)
    found.cuts.append(cut)
    return new


def _join(parts: list[_Part], found: Objects) -> Objects:
    for part in parts:
        found.keys += part.found.keys
        found.sizes += part.found.sizes
        found.etags += part.found.etags
    return found
