"""One writer at a time where MLflow has no atomic find-or-create: a file lock beside a local store.

Two executions of one study started in the same second are a normal case. MLflow's SQL
store cannot say "create this parent run unless one exists", and a brand-new SQLite file
gets its tables from whichever process touches it first (two at once collide: ``table
latest_metrics already exists``). For a local SQLite store the executions are on this
machine, so a file lock next to the database (``mlflow.db.lock``) serialises those short
steps: creating the store's tables, finding or creating a study's parent, finding or
creating a cell's run. A tracking server's executions may be on other hosts: there this
lock is a no-op and ``tracking.record.create_once`` decides (create, wait, the first candidate wins).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_TIMEOUT_ENV = "WORKBENCH_STORE_LOCK_SECONDS"
DEFAULT_LOCK_TIMEOUT = 300.0  # the steps it guards take well under a second; a busy store some more
_LOCKS: dict[str, FileLock] = {}
_GUARD = threading.Lock()
_READY: set[str] = set()


class StoreLockTimeout(RuntimeError):
    """Another process held the store's lock for too long; the message names the lock file."""


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store URI (relative to the current folder), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path).resolve() if path and path != ":memory:" else None


def _lock_for(path: Path) -> FileLock:
    # One FileLock object per file in this process: nested holds in one thread re-enter it;
    # other threads and processes wait.
    with _GUARD:
        return _LOCKS.setdefault(str(path), FileLock(f"{path}.lock"))


@contextlib.contextmanager
def store_lock(uri: str):
    """Hold the store's lock for a find-or-create (a no-op for anything but a local SQLite store)."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock_for(path)
    timeout = float(os.environ.get(LOCK_TIMEOUT_ENV) or DEFAULT_LOCK_TIMEOUT)
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        raise StoreLockTimeout(
            f"{path}.lock: another process has held this MLflow store's lock for over "
            f"{timeout:g} s (a stalled execution?); nothing was written"
        ) from None
    try:
        yield
    finally:
        lock.release()


def writable(path: Path) -> bool:
    """Whether this process can write the store file and its folder (read-only mount, permissions)."""
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def ensure_store(uri: str) -> None:
    """Let MLflow create a new SQLite store's tables (or check an existing one) under the lock, once per process.

    An existing store that cannot be written (a read-only mount, a copy shared for reading)
    is opened without the lock: its tables exist, nothing is created, and the lock file
    could not be made beside it anyway. Reading needs no lock.
    """
    path = sqlite_path(uri)
    if uri in _READY or path is None:
        return
    from mlflow.tracking import MlflowClient

    if path.exists() and not writable(path):
        MlflowClient(uri).search_experiments(max_results=1)
    else:
        with store_lock(uri):
            # builds the store: tables and migrations
            MlflowClient(uri).search_experiments(max_results=1)
    _READY.add(uri)
