"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A crash at any point leaves either the previous file or the new one, never half of one.
Every write that must not be lost (checkpoints, lock file, caches, predictions, reports)
goes through here.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable

try:
    import fcntl
except ImportError:  # not POSIX: temp files are not locked, and none is ever taken as abandoned
    fcntl = None


def current_umask() -> int:
    """The process umask, read without changing it where the platform allows (Linux /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it (briefly process-wide), then restore
    os.umask(mask)
    return mask


# A failed write that leaves less than this free on the file system is taken as a full disk:
# torch.save reports a short write as "[enforce fail at inline_container.cc] unexpected pos".
FULL_DISK_BYTES = 1 << 20


class WriteFailed(OSError):
    """A write that did not happen, naming the file (the previous version, if any, is intact)."""

    def __str__(self) -> str:
        return self.strerror


def _disk_full(folder: Path, err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


# A temp file younger than this is never taken as abandoned: its writer may not hold its lock yet.
ABANDONED_AFTER_SECONDS = 120.0


def _hold(fd: int) -> None:
    """Lock the temp file for as long as its writer lives (the kernel drops it when the process dies)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)


def remove_abandoned_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the temp files of ``atomic_write`` in ``folder`` whose writer is gone; returns them.

    A write killed with SIGKILL (or a lost machine) cannot remove its temp file; a writer
    still alive holds a lock on it, so a temp file nobody holds and older than
    ``ABANDONED_AFTER_SECONDS`` is a leftover. Two processes may clean at once.
    """
    removed: list[Path] = []
    if fcntl is None:
        return removed
    for tmp in Path(folder).glob(".*.tmp"):
        try:
            if time.time() - tmp.stat().st_mtime < ABANDONED_AFTER_SECONDS:
                continue
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live writer holds it
        else:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
        finally:
            os.close(fd)
    return removed


def atomic_write(
    path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int | None = None
) -> None:
    """Call ``write(f)`` on a temp file beside ``path``, make it durable, rename it over ``path``.

    ``mode``: permission bits of the new file, masked by the umask as ``open()`` would mask
    them (0o666 gives 0644 under the usual umask 022). Default: the temp file's 0600, for
    files only their owner should read (checkpoints, caches, lock files).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteFailed(err.errno, f"cannot write {path}: {err.strerror or err}") from err
    try:
        _hold(fd)
        if mode is not None:
            os.fchmod(fd, mode & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        # before the temp file goes
        full = isinstance(err, (OSError, RuntimeError)) and _disk_full(path.parent, err)
        Path(tmp).unlink(missing_ok=True)
        if full:
            raise WriteFailed(errno.ENOSPC, f"no space left on device writing {path}") from err
        if isinstance(err, OSError) and not isinstance(err, WriteFailed):
            raise WriteFailed(err.errno, f"cannot write {path}: {err.strerror or err}") from err
        raise
    try:  # make the rename itself durable; not every platform can open a folder
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    atomic_write(path, lambda f: f.write(data), mode)
