"""Never let Optuna share a database with MLflow.

Optuna creates its tables in whatever database its storage URL names; in MLflow's
database they break MLflow's schema check (a misleading "version" error on the next
start). The guard compares *resolved locations*, not spellings: the same SQLite file by
its resolved path (``sqlite:///mlflow.db`` from this folder and ``sqlite:////abs/mlflow.db``
are one file), the same PostgreSQL or MySQL database by host, port and name (``localhost``
and ``127.0.0.1`` are one host, a missing port is the default one). It is checked against
the tracking store, the local fallback store and, on the server's machine, the server's
backend and users databases. Call it before anything is created.
"""

from __future__ import annotations

import os
from pathlib import Path

from tracking.store import offline_store, uris

DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433}
LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}
SERVER_DATABASES = ("WORKBENCH_SERVER_BACKEND_URI", "WORKBENCH_SERVER_AUTH_DB_URI")


def location(url: str) -> tuple | None:
    """Where a storage / store URL keeps its data: ``("file", path)``, ``("postgresql", host, port, db)``;
    None for what holds no database (HTTP, in-memory SQLite, a file store folder)."""
    if url.startswith("journal:"):
        return ("file", str(Path(url.removeprefix("journal:")).expanduser().resolve()))
    if "://" not in url or url.startswith(("http://", "https://", "file:")):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    family = parsed.get_backend_name()
    if family == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            return None
        return ("file", str(Path(parsed.database).expanduser().resolve()))
    host = (parsed.host or "localhost").lower()
    host = "loopback" if host in LOOPBACK else host
    return (family, host, parsed.port or DEFAULT_PORTS.get(family), parsed.database)


def stores_in_use() -> dict[str, str]:
    """MLflow's databases this process could write to or sit beside: what -> URL."""
    stores = {"the MLflow tracking store": uris.tracking_uri(), "the local fallback store": offline_store.fallback_uri()}
    for env in SERVER_DATABASES:
        if os.environ.get(env):
            stores[f"the tracking server's database ({env})"] = os.environ[env]
    return stores


def check_optuna_storage(storage: str) -> None:
    """Refuse an Optuna storage URL that cannot work (an unknown scheme, a file that is not
    an SQLite database) or that is one of MLflow's databases.

    Raises:
        ValueError: One line naming the URL (passwords hidden), what is wrong and what to do
            (``studies.runtime.options.check_storage_option`` says it as a ``--storage`` usage error).
    """
    check_storage_url(storage)
    check_sqlite_file(storage)
    mine = location(storage)
    if mine is None:
        return
    for what, uri in stores_in_use().items():
        if location(uri) == mine:
            raise ValueError(
                f"{uris.redact_uri(storage)} is {what} ({uris.redact_uri(uri)}); Optuna would write its tables into "
                "MLflow's database. Give Optuna a database of its own, e.g. sqlite:///optuna.db or "
                "postgresql://.../optuna")


SQLITE_HEADER = b"SQLite format 3\x00"
STORAGE_EXAMPLES = "postgresql://user@host/optuna, sqlite:///optuna.db or journal:/shared/queue.log"


def check_storage_url(url: str) -> None:
    """Refuse a storage URL SQLAlchemy cannot use: no scheme, or a database it has no dialect for.

    Raises:
        ValueError: naming the URL (password hidden) and the valid forms.
    """
    if url.startswith("journal:"):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as err:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        what = f"unknown database scheme {scheme!r}" if scheme else "not a database URL"
        raise ValueError(f"{uris.redact_uri(url)}: {what}; give e.g. {STORAGE_EXAMPLES}") from err


def sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:`` URL, else None (journal files are not SQLite)."""
    where = location(url)
    if url.startswith("journal:") or where is None or where[0] != "file":
        return None
    return Path(where[1])


def check_sqlite_file(url: str, what: str = "") -> None:
    """Refuse a ``sqlite:`` URL whose file exists but is not an SQLite database (an empty
    file is one SQLite will initialise).

    Raises:
        ValueError: naming the file and, if given, the setting it came from.
    """
    path = sqlite_file(url)
    if path is None or not path.exists():
        return
    named = f"{what}={uris.redact_uri(url)}: " if what else f"{uris.redact_uri(url)}: "
    if path.is_dir():
        raise ValueError(f"{named}{path} is a folder, not an SQLite database file")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if head and head != SQLITE_HEADER:
        raise ValueError(f"{named}{path} is not an SQLite database (its first bytes are {head[:8].hex(' ')})")


def check_sqlite_writable(url: str, what: str = "") -> None:
    """Refuse a ``sqlite:`` store this process cannot write: SQLite needs the file and its
    folder (for its journal) writable, and the folder must exist.

    Raises:
        ValueError: naming the file or folder and, if given, the setting it came from.
    """
    path = sqlite_file(url)
    if path is None:
        return
    named = f"{what}={uris.redact_uri(url)}: " if what else f"{uris.redact_uri(url)}: "
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{named}the folder {folder} does not exist")
    for target in ([path] if path.exists() else []) + [folder]:
        if not os.access(target, os.W_OK):
            raise ValueError(f"{named}{target} is read-only (cannot write there); point it at a writable store")
