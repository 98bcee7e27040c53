"""Never let Optuna share a database with MLflow.

Optuna creates its tables in whatever database its storage URL names; in MLflow's
database they break MLflow's schema check (a misleading "version" error on the next
start), and both keep their schema revision in one ``alembic_version`` table. Two checks,
both before anything is created:

- *Looking inside* the target database, from any machine (``look_inside``): a storage
  whose database holds MLflow's tables (``experiments``, ``runs``, ``alembic_version`` at
  one of MLflow's revisions, or its users database's ``alembic_version_auth``) is refused
  for Optuna; a tracking store (or a server's database) that holds Optuna's tables
  (``studies``, ``trials``, ``version_info``) is refused for MLflow. A client machine
  knows nothing of the server's settings; the database itself says what it holds.
- *Resolved locations*, which catch a store MLflow has not written yet: the same SQLite
  file by its resolved path (``sqlite:///mlflow.db`` from this folder and
  ``sqlite:////abs/mlflow.db`` are one file), the same PostgreSQL or MySQL database by
  host, port and name (``localhost`` and ``127.0.0.1`` are one host, a missing port is
  the default one), against the tracking store, the local fallback store and, on the
  server's machine, the server's backend and users databases.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sqlite3
from dataclasses import dataclass
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
    stores = {
        "the MLflow tracking store": uris.tracking_uri(),
        "the local fallback store": offline_store.fallback_uri(),
    }
    for env in SERVER_DATABASES:
        if os.environ.get(env):
            stores[f"the tracking server's database ({env})"] = os.environ[env]
    return stores


def check_optuna_storage(storage: str) -> None:
    """Refuse an Optuna storage URL that cannot work (an unknown scheme, a file that is not
    an SQLite database, a database that cannot be reached) or that is one of MLflow's
    databases: by location against this machine's stores, and by looking inside.

    Raises:
        ValueError: One line naming the URL (passwords hidden), what is wrong and what to do
            (``studies.runtime.options.check_storage_option`` says it as a ``--storage`` usage error).
    """
    check_storage_url(storage)
    check_sqlite_file(storage)
    mine = location(storage)
    for what, uri in stores_in_use().items() if mine else ():
        if location(uri) == mine:
            raise ValueError(
                f"{uris.redact_uri(storage)} is {what} ({uris.redact_uri(uri)}); Optuna would write its tables into "
                "MLflow's database. Give Optuna a database of its own, e.g. sqlite:///optuna.db or "
                "postgresql://.../optuna"
            )
    # what this machine's settings cannot know: the database itself says whose it is (StorageClash is a ValueError)
    refuse_mlflow_database(storage)


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
        raise ValueError(
            f"{named}{path} is not an SQLite database (its first bytes are {head[:8].hex(' ')})"
        )


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
            raise ValueError(
                f"{named}{target} is read-only (cannot write there); point it at a writable store"
            )


# ------------------------------------------------------------------ looking inside a database

MLFLOW_TABLES = ("experiments", "runs")
MLFLOW_AUTH_VERSION_TABLE = "alembic_version_auth"  # MLflow's users database (basic-auth)
OPTUNA_TABLES = ("studies", "trials", "version_info")
CONNECT_TIMEOUT_SECONDS = 10


class StorageClash(ValueError):
    """A database that holds the other tool's tables (or cannot be looked into)."""


@dataclass(frozen=True)
class Schema:
    """What a database holds: its table names and the revision in ``alembic_version``."""

    tables: frozenset[str]
    revision: str | None = None


@functools.lru_cache(maxsize=1)
def _revisions() -> tuple[frozenset[str], frozenset[str]]:
    """(MLflow's schema revisions, Optuna's), read from their migration scripts (nothing imported)."""
    import importlib.util

    def scripts(package: str, *sub: str) -> list[Path]:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return []
        return list(Path(spec.submodule_search_locations[0], *sub).glob("*.py"))

    found = []
    for files in (
        scripts("mlflow", "store", "db_migrations", "versions"),
        scripts("optuna", "storages", "_rdb", "alembic", "versions"),
    ):
        ids = set()
        for path in files:
            match = re.search(
                r"^revision\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]",
                path.read_text(),
                re.MULTILINE,
            )
            if match:
                ids.add(match.group(1))
        found.append(frozenset(ids))
    return found[0], found[1]


def _sqlite_schema(path: Path) -> Schema:
    """Read-only (an existing file is never changed, a missing one never created)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
        tables = frozenset(
            r[0] for r in db.execute("select name from sqlite_master where type = 'table'")
        )
        revision = None
        if "alembic_version" in tables:
            row = db.execute("select version_num from alembic_version").fetchone()
            revision = row[0] if row else None
    return Schema(tables, revision)


def _server_schema(url: str) -> Schema:
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    args = (
        {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
        if parsed.get_backend_name() == "postgresql"
        else {}
    )
    engine = create_engine(parsed, poolclass=NullPool, connect_args=args)
    try:
        with engine.connect() as conn:
            tables = frozenset(inspect(conn).get_table_names())
            revision = None
            if "alembic_version" in tables:
                revision = conn.execute(text("select version_num from alembic_version")).scalar()
    finally:
        engine.dispose()
    return Schema(tables, revision)


def look_inside(url: str) -> Schema | None:
    """The schema of the database ``url`` names; None when there is none to look at yet (a SQLite
    file that does not exist or is empty, HTTP, a journal file, in-memory SQLite).

    Raises:
        StorageClash: the database cannot be reached (naming it, password hidden, and why).
    """
    if url.startswith("journal:") or location(url) is None:
        return None
    path = sqlite_file(url)
    if path is not None:
        if not path.is_file() or path.stat().st_size == 0:
            return None
        try:
            return _sqlite_schema(path)
        except sqlite3.Error as err:  # locked, unreadable: named, never a traceback
            raise StorageClash(
                f"{uris.redact_uri(url)}: cannot look into this database ({err})"
            ) from None
    try:
        return _server_schema(url)
    except Exception as err:  # noqa: BLE001 - the driver's own errors: one line, named
        reason = " ".join(str(getattr(err, "orig", None) or err).split())[:300]
        hint = _login_hint(url) if "password" in reason.lower() else ""
        raise StorageClash(
            f"{uris.redact_uri(url)}: cannot look into this database ({uris.redact_uri(reason)}){hint}"
        ) from None


def _login_hint(url: str) -> str:
    """What to check when the database refused a login: the URL's own password, or where libpq looked.

    libpq matches a ``.pgpass`` line's host as written (``localhost`` is not ``127.0.0.1``), so
    the line it needed is spelled out from the URL (no secret in it: the URL holds no password).
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.password:
        return (
            "; the password in the URL was refused: check it, or leave it out of the URL and give "
            "it in PGPASSWORD or ~/.pgpass (PGPASSFILE)"
        )
    passfile = os.environ.get("PGPASSFILE") or "~/.pgpass"
    line = f"{parsed.host or 'localhost'}:{parsed.port or 5432}:{parsed.database or '*'}:{parsed.username or '*'}"
    return (
        f"; no password in the URL, none accepted from PGPASSWORD or {passfile}: libpq needs a line "
        f"{line}:PASSWORD there (mode 0600), its host written as in the URL (localhost and "
        "127.0.0.1 are different hosts to it)"
    )


def mlflow_signs(schema: Schema) -> list[str]:
    """What in ``schema`` is MLflow's (empty: nothing)."""
    mlflow_revisions, _ = _revisions()
    signs = [t for t in (*MLFLOW_TABLES, MLFLOW_AUTH_VERSION_TABLE) if t in schema.tables]
    if schema.revision and schema.revision in mlflow_revisions:
        signs.append(f"alembic_version at MLflow's revision {schema.revision}")
    return signs


def optuna_signs(schema: Schema) -> list[str]:
    """What in ``schema`` is Optuna's (empty: nothing)."""
    _, optuna_revisions = _revisions()
    signs = [t for t in OPTUNA_TABLES if t in schema.tables]
    if schema.revision and schema.revision in optuna_revisions:
        signs.append(f"alembic_version at Optuna's revision {schema.revision}")
    return signs


def refuse_mlflow_database(storage: str) -> None:
    """Refuse an Optuna storage whose database holds MLflow's tables (or an SQLite file as a journal).

    Raises:
        StorageClash: one line naming the database (password hidden) and what MLflow keeps there.
    """
    if storage.startswith("journal:"):
        path = Path(storage.removeprefix("journal:")).expanduser()
        with contextlib.suppress(OSError):
            if path.is_file():
                with open(path, "rb") as f:
                    if f.read(len(SQLITE_HEADER)) == SQLITE_HEADER:
                        raise StorageClash(
                            f"{storage}: {path.resolve()} is an SQLite database, not an Optuna journal "
                            "file; Optuna would append its log to it. Give the journal a file of its own"
                        )
        return
    schema = look_inside(storage)
    signs = mlflow_signs(schema) if schema else []
    if signs:
        raise StorageClash(
            f"{uris.redact_uri(storage)} is one of MLflow's databases (it holds {', '.join(signs)}); "
            "Optuna would write its tables into it and break both. Give Optuna a database of its own, "
            "e.g. postgresql://.../optuna or sqlite:///optuna.db; nothing was created"
        )


_checked_for_mlflow: set[str] = set()


def refuse_optuna_database(uri: str, what: str) -> None:
    """Refuse an MLflow store (``what``: the setting it came from) whose database holds Optuna's tables.

    A database that cannot be reached is left to MLflow to report. Checked once per process and URI.

    Raises:
        ValueError: one line naming the setting and the database (password hidden).
    """
    if uri in _checked_for_mlflow or location(uri) is None:
        return
    try:
        schema = look_inside(uri)
    except StorageClash:
        return
    signs = optuna_signs(schema) if schema else []
    if signs:
        raise ValueError(
            f"{what}={uris.redact_uri(uri)} is an Optuna storage (it holds {', '.join(signs)}); MLflow "
            "would write its tables into it and break both. Give MLflow a database of its own; "
            "nothing was created"
        )
    _checked_for_mlflow.add(uri)
