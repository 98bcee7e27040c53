"""One-line explanations of errors raised by a database under MLflow or Optuna.

SQLite says what went wrong in a few fixed phrases (read-only database, disk full, not a
database, cannot open the file), buried in SQLAlchemy's and MLflow's wrapping: an INSERT
statement, its parameters, a link. ``explain`` finds the phrase anywhere in the chain of
exceptions and says it in one line naming the store. Which store is told by where the
error was raised: Optuna's code (the ``--storage`` queue) or MLflow's (the tracking store).
The command-line error handler calls it for any error that is not a usage error.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback


# SQLite's phrase -> what it means for the user.
_SQLITE_PHRASES = {
    "attempt to write a readonly database": "is read-only (the file or its folder cannot be written)",
    "database or disk is full": "cannot grow: no space left on device",
    "file is not a database": "is not an SQLite database",
    "unable to open database file": "cannot be opened (a missing folder, or one without write permission)",
    "disk i/o error": "hit a disk I/O error (a full or read-only file system?)",
}


def _chain(err: BaseException):
    from tracking.store.health import exception_chain  # every cause and context, once each

    return exception_chain(err)


def _raised_in(err: BaseException, package: str) -> bool:
    marker = f"{os.sep}{package}{os.sep}"
    return any(
        marker in frame.filename
        for e in _chain(err)
        for frame in traceback.extract_tb(e.__traceback__)
    )


def _store_name(err: BaseException) -> str:
    if _raised_in(err, "optuna"):
        return "the Optuna storage (--storage)"
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if "mlflow" in sys.modules:  # the store this process writes to, the local fallback included
        uri = sys.modules["mlflow"].get_tracking_uri()
    from tracking.store.uris import redact_uri

    return f"the MLflow store {redact_uri(uri)}"


# errno of a file write -> what it means for the store being written.
_WRITE_ERRNOS = {
    errno.ENOSPC: "is full: no space left on device",
    errno.EDQUOT: "is full: disk quota exceeded",
    errno.EROFS: "is read-only (a read-only file system)",
}


def _artifact_store(err: BaseException) -> str | None:
    """The artifact location an MLflow artifact repository was writing when ``err`` was raised, if any.

    A file write deep in MLflow (``shutil.copyfileobj``) says only ``[Errno 28] No space left
    on device``, without a file name; the repository object in the raising frames knows where.
    """
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if type(owner).__name__.endswith("ArtifactRepository") and getattr(
            owner, "artifact_uri", None
        ):
            return str(owner.artifact_uri)
        tb = tb.tb_next
    return None


def _write_problem(err: BaseException) -> str | None:
    """A full or read-only file system under the tracking store's artifacts or its database file."""
    from tracking.store.uris import redact_uri

    for link in _chain(err):
        if not isinstance(link, OSError) or link.errno not in _WRITE_ERRNOS:
            continue
        meaning = _WRITE_ERRNOS[link.errno]
        where = _artifact_store(link)
        if where:
            return (
                f"the MLflow artifact store {redact_uri(where)} {meaning} ({_store_name(err)} keeps its run "
                f"artifacts there); nothing more was logged to that run"
            )
        if _raised_in(link, "mlflow"):
            return f"{_store_name(err)} {meaning} ({link.strerror})"
    return None


def explain(err: BaseException) -> str | None:
    """One line for a database or store write error anywhere in ``err``'s chain, or None if it is not one."""
    for link in _chain(err):
        text = str(link).lower()
        for phrase, meaning in _SQLITE_PHRASES.items():
            if phrase in text:
                return f"{_store_name(err)} {meaning} (SQLite: {phrase})"
    return _write_problem(err)
