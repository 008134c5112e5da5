"""Persistent cache of measured node costs: one SQLite file, shared by processes (no torch).

The file is ``$FITGRAPH_CACHE_DIR/costs.sqlite`` if that variable is set, else
``platformdirs.user_cache_dir("fitgraph")/costs.sqlite``. Keys are opaque strings made by the
profiler (a hash of the op, its input layouts, the device, torch version and thread count), so
a stale entry is never reused for a different setup. Each call opens its own short connection
with a generous lock timeout, so concurrent processes (pytest-xdist, two notebooks) can profile
into one file.

Example:
    >>> import tempfile
    >>> from fitgraph.cost.cache import CacheEntry, CostCache
    >>> c = CostCache(tempfile.mkdtemp())
    >>> c.put("k", CacheEntry(1e-3, 0, 64), device="cpu", torch_version="2.5", target="aten.relu")
    >>> c.get("k").end_bytes, len(c)
    (64, 1)
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_ENV", "CacheEntry", "CostCache", "default_cache_path"]

CACHE_ENV = "FITGRAPH_CACHE_DIR"
CACHE_FILE = "costs.sqlite"
# NOTE: seconds a writer waits for another process's lock before sqlite raises "database is
# locked"; profiling writes are tiny, so only a stuck process would exceed this.
_LOCK_TIMEOUT_S = 60.0
_CHUNK = 500  # NOTE: stays under SQLite's default limit on host parameters per statement

_SCHEMA = """
CREATE TABLE IF NOT EXISTS costs (
    key TEXT PRIMARY KEY,
    seconds REAL NOT NULL,
    workspace_bytes INTEGER NOT NULL,
    end_bytes INTEGER NOT NULL,
    device TEXT,
    torch_version TEXT,
    created REAL,
    target TEXT
)"""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    seconds: float
    workspace_bytes: int
    end_bytes: int      # net allocator bytes still held after the node (its real outputs)


def default_cache_path() -> Path:
    """``$FITGRAPH_CACHE_DIR/costs.sqlite``, else the platform's user cache dir."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env) / CACHE_FILE
    import platformdirs

    return Path(platformdirs.user_cache_dir("fitgraph")) / CACHE_FILE


class CostCache:
    """A key -> CacheEntry table in SQLite.

    Args:
        path: a ``.sqlite``/``.db`` file, or a directory (the file ``costs.sqlite`` in it);
            None = ``default_cache_path()``.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        if path is None:
            p = default_cache_path()
        else:
            p = Path(path)
            if p.suffix not in (".sqlite", ".db", ".sqlite3"):
                p = p / CACHE_FILE
        p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p
        with self._connect() as con, con:
            con.execute(_SCHEMA)

    def _connect(self) -> closing[sqlite3.Connection]:
        return closing(sqlite3.connect(self.path, timeout=_LOCK_TIMEOUT_S))

    def get(self, key: str) -> CacheEntry | None:
        return self.get_many([key]).get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, CacheEntry]:
        keys = list(dict.fromkeys(keys))
        out: dict[str, CacheEntry] = {}
        with self._connect() as con:
            for i in range(0, len(keys), _CHUNK):
                chunk = keys[i:i + _CHUNK]
                rows = con.execute(
                    "SELECT key, seconds, workspace_bytes, end_bytes FROM costs WHERE key IN "
                    f"({','.join('?' * len(chunk))})", chunk).fetchall()
                for k, s, w, e in rows:
                    out[k] = CacheEntry(float(s), int(w), int(e))
        return out

    def put(self, key: str, entry: CacheEntry, *, device: str, torch_version: str,
            target: str = "") -> None:
        # NOTE: one transaction per entry, so an interrupted profile keeps what it measured
        with self._connect() as con, con:
            con.execute("INSERT OR REPLACE INTO costs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (key, entry.seconds, entry.workspace_bytes, entry.end_bytes, device,
                         torch_version, time.time(), target))

    def __len__(self) -> int:
        with self._connect() as con:
            return int(con.execute("SELECT COUNT(*) FROM costs").fetchone()[0])

    def clear(self) -> None:
        """Delete every entry (e.g. after a driver or hardware change)."""
        with self._connect() as con, con:
            con.execute("DELETE FROM costs")

    def __repr__(self) -> str:
        return f"CostCache({str(self.path)!r})"
