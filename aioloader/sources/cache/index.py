"""The cache's index: each object's size and last use, and eviction of the least recently used.

One SQLite file (`ROOT/index.sqlite`, WAL) shared by every process using the cache directory: a
write transaction (`BEGIN IMMEDIATE`) serialises adding and evicting across processes. The last
use is the cache's own record (wall-clock seconds, written in batches by `record`), not the file
system's atime. Every method blocks: the cache calls them in threads.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

__all__ = ["Index"]

# Seconds a process waits for another's write transaction before SQLite gives up.
_BUSY_S = 60.0
# Eviction candidates read per query, oldest first.
_BATCH = 64
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (id TEXT PRIMARY KEY, size INTEGER NOT NULL, used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used);
CREATE TABLE IF NOT EXISTS total (one INTEGER PRIMARY KEY CHECK (one = 0), bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO total VALUES (0, 0);
"""


def _write_ahead(db: sqlite3.Connection) -> None:
    """Put `db` in WAL mode. Where processes open a new index at once, one converts it and the
    others' conversion fails at once with "database is locked" (SQLite's busy timeout does not
    cover it), so they try again, polled (another process holds it), for up to `_BUSY_S`."""
    deadline, delay = time.monotonic() + _BUSY_S, 0.001
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


class Index:
    """The entries of one cache directory. Thread-safe (one connection, used under a lock)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "index.sqlite"
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(
                self.path, timeout=_BUSY_S, isolation_level=None, check_same_thread=False
            )
            _write_ahead(db)
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    def reconcile(self, found: Iterable[tuple[str, int]], exists: Callable[[str], bool]) -> None:
        """Make the index agree with the files: add the objects `found` on disk that it lacks (as
        least recently used), drop entries whose object is gone, and recount the total."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(
                    "INSERT OR IGNORE INTO entries VALUES (?, ?, 0)", [(i, s) for i, s in found]
                )
                gone = [(i,) for (i,) in db.execute("SELECT id FROM entries") if not exists(i)]
                db.executemany("DELETE FROM entries WHERE id = ?", gone)
                db.execute("UPDATE total SET bytes = (SELECT COALESCE(SUM(size), 0) FROM entries)")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def record(
        self, added: Mapping[str, int], used: Mapping[str, float], limit: int | None,
        evict: Callable[[str], bool],
    ) -> int:  # fmt: skip
        """In one transaction: record the objects `added` (id -> size) as just used and the last
        use of those in `used` (id -> wall-clock seconds); then, while the total is over `limit`,
        evict the least recently used others (`evict(id)` deletes one's files, or returns False
        when a download holds it). Returns the number evicted."""
        if not added and not used:
            return 0
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                evicted = self._record(db, added, used, limit, evict)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return evicted

    def _record(
        self, db: sqlite3.Connection, added: Mapping[str, int], used: Mapping[str, float],
        limit: int | None, evict: Callable[[str], bool],
    ) -> int:  # fmt: skip
        (total,) = db.execute("SELECT bytes FROM total").fetchone()
        now = time.time()
        for id, size in added.items():
            old = db.execute("SELECT size FROM entries WHERE id = ?", (id,)).fetchone()
            db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (id, size, now))
            total += size - (old[0] if old else 0)
        db.executemany(
            "UPDATE entries SET used = MAX(used, ?) WHERE id = ?", [(t, i) for i, t in used.items()]
        )
        evicted, total = self._evict(db, set(added), total, limit, evict)
        db.execute("UPDATE total SET bytes = ?", (total,))
        return evicted

    @staticmethod
    def _evict(
        db: sqlite3.Connection, keep: set[str], total: int, limit: int | None,
        evict: Callable[[str], bool],
    ) -> tuple[int, int]:  # fmt: skip
        evicted, skipped = 0, 0
        while limit is not None and total > limit:
            rows = db.execute(
                "SELECT id, size FROM entries ORDER BY used LIMIT ? OFFSET ?", (_BATCH, skipped)
            ).fetchall()
            if not rows:
                break
            for victim, size in rows:
                if total <= limit:
                    break
                if victim in keep or not evict(victim):
                    skipped += 1
                    continue
                db.execute("DELETE FROM entries WHERE id = ?", (victim,))
                total -= size
                evicted += 1
        return evicted, total

    def drop(self, id: str) -> None:
        """Forget object `id` (its files are gone)."""
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT size FROM entries WHERE id = ?", (id,)).fetchone()
                if row is not None:
                    db.execute("DELETE FROM entries WHERE id = ?", (id,))
                    db.execute("UPDATE total SET bytes = bytes - ?", (row[0],))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        """Close the connection (a later call opens it again)."""
        with self._lock:
            db, self._db = self._db, None
            if db is not None:
                db.close()
