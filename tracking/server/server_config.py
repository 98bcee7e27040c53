"""The shared MLflow tracking server: PostgreSQL backend store, proxied artifacts, basic-auth.

Remote GPU workers (a Colab T4, a cluster node) log to it over HTTP(S) with
MLFLOW_TRACKING_URI / MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. This module
builds the ``mlflow server`` command and its environment; ``tracking.server.server_process`` runs
it and ``tracking.server.server_users`` administers its users and grants.

- Secrets stay out of the command line and, as far as MLflow allows, out of the server's
  environment: a PostgreSQL password (in a URI, or the launcher's ``PGPASSWORD``) goes
  into a ``.pgpass`` file (``PGPASSFILE``) and the URIs the server sees carry none; the
  admin account is created by the launcher before the server starts, so the admin
  password never reaches the server at all. The server's environment is an allow-list
  (``tracking.store.child_env.server_env``): nothing else of the launcher's shell reaches it.
- Those files (``.pgpass``, ``basic_auth.ini``) live in a private runtime folder (mode
  0700) that is removed when the server stops, even when its launcher is SIGKILLed.
- Artifacts are proxied (``--serve-artifacts --artifacts-destination``): workers need no
  storage credentials of their own.
- Users may read every experiment and change only their own (default permission READ;
  MLflow gives the creator of an experiment MANAGE).
- ``--allowed-hosts`` / ``--cors-allowed-origins`` must name the public host when the
  server sits behind a tunnel or reverse proxy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tracking.store.child_env import server_env
from tracking.store.uris import redact_uri

ADMIN_USER_ENV = "WORKBENCH_SERVER_ADMIN_USER"
ADMIN_PASSWORD_ENV = "WORKBENCH_SERVER_ADMIN_PASSWORD"
BACKEND_ENV = "WORKBENCH_SERVER_BACKEND_URI"
ARTIFACTS_ENV = "WORKBENCH_SERVER_ARTIFACTS"
AUTH_DB_ENV = "WORKBENCH_SERVER_AUTH_DB_URI"
NEW_USER_PASSWORD_ENV = "WORKBENCH_NEW_USER_PASSWORD"
# The admin password older MLflow versions shipped in basic_auth.ini (GHSA-gq3w-7jj3-x7gr).
LEGACY_DEFAULT_PASSWORD = "password1234"
MIN_PASSWORD = 12  # MLflow's own minimum for basic-auth passwords
# basic-auth's default_permission: what users may do where they hold no grant.
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
AUTH_CACHE_SECONDS = 60


# mlflow.server.fastapi_app (imported by the server, the launcher and every admin call) imports
# starlette's deprecated WSGI module, which warns in two lines on every command; nothing a
# user can act on. Only that warning is silenced: here for this process, and through
# PYTHONWARNINGS (same message, category and module) for the server's processes.
_STARLETTE_WSGI = (
    "starlette.middleware.wsgi is deprecated",
    "UserWarning",
    "mlflow.server.fastapi_app",
)
warnings.filterwarnings(
    "ignore", message=_STARLETTE_WSGI[0], category=UserWarning, module=_STARLETTE_WSGI[2]
)


class ServerConfigError(ValueError):
    """A server setting that must be fixed before the server may start."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``mlflow server`` needs, validated.

    Attributes:
        backend_store_uri: Runs and experiments, e.g. ``postgresql://mlflow@127.0.0.1/mlflow``.
        artifacts_destination: Where proxied artifacts are stored (a folder, ``s3://...``).
        auth_database_uri: Users and permissions of basic-auth; default a SQLite file beside
            the working directory. Use a database of its own (``postgresql://.../mlflow_auth``).
        default_permission: What every user may do on experiments others created. READ:
            everyone sees everything, only the creator (MANAGE) and those granted EDIT change it.
        allowed_hosts: Host headers to accept (the tunnel's hostname); MLflow's default
            accepts localhost and private addresses only.
        cors_allowed_origins: Browser origins allowed to call the API.
    """

    backend_store_uri: str
    artifacts_destination: str
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 2
    auth: bool = True
    auth_database_uri: str | None = None
    default_permission: str = "READ"
    allowed_hosts: str | None = None
    cors_allowed_origins: str | None = None

    def __post_init__(self) -> None:
        if not self.backend_store_uri:
            raise ServerConfigError(
                f"no backend store: pass --backend-store-uri or set {BACKEND_ENV}"
            )
        if not self.artifacts_destination:
            raise ServerConfigError(
                f"no artifact destination: pass --artifacts-destination or set {ARTIFACTS_ENV}"
            )
        if self.default_permission not in PERMISSIONS:
            raise ServerConfigError(
                f"default permission {self.default_permission!r}: one of {', '.join(PERMISSIONS)}"
            )
        if not 0 < self.port < 65536:
            raise ServerConfigError(f"port {self.port}: not a TCP port")
        if self.workers < 1:
            raise ServerConfigError(f"workers {self.workers}: at least 1")

    def auth_db(self) -> str:
        return self.auth_database_uri or f"sqlite:///{Path('mlflow-auth.db').resolve()}"

    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def check_admin_credentials(user: str | None, password: str | None) -> None:
    """Refuse to start a basic-auth server with a missing, default or weak admin password.

    Raises:
        ServerConfigError: Naming the environment variable to set (never the password).
    """
    if not user:
        raise ServerConfigError(f"set {ADMIN_USER_ENV} to the admin user's name")
    if not password:
        raise ServerConfigError(
            f"set {ADMIN_PASSWORD_ENV} to the admin password (at least {MIN_PASSWORD} characters)"
        )
    if password == LEGACY_DEFAULT_PASSWORD:
        raise ServerConfigError(
            f"{ADMIN_PASSWORD_ENV} is MLflow's old published default admin password; choose another"
        )
    if len(password) < MIN_PASSWORD:
        raise ServerConfigError(f"{ADMIN_PASSWORD_ENV} is shorter than {MIN_PASSWORD} characters")
    if password == user or password.lower() in (user.lower() * 3, "admin" * 3):
        raise ServerConfigError(f"{ADMIN_PASSWORD_ENV} must not be derived from the user name")


def pgpass_line(url, password: str) -> str:
    """The ``.pgpass`` line (host:port:database:user:password, escaped) of a parsed PostgreSQL URL."""

    def esc(value) -> str:
        return str(value).replace("\\", "\\\\").replace(":", "\\:")

    return ":".join(
        esc(v)
        for v in (
            url.host or "localhost",
            url.port or 5432,
            url.database or "*",
            url.username or "*",
            password,
        )
    )


def split_password(uri: str, pgpassword: str | None = None) -> tuple[str, str | None]:
    """``(uri without its password, the .pgpass line holding it)`` for PostgreSQL; other URIs unchanged.

    libpq (under psycopg) reads the password from the file named by PGPASSFILE, so the
    URI the server keeps in its environment holds none. ``pgpassword``: the launcher's
    ``PGPASSWORD``, the password of a URI that has none (it goes into the file too, so the
    server's environment never holds it).
    """
    if not uri.startswith("postgresql"):
        return uri, None
    from sqlalchemy.engine import make_url

    url = make_url(uri)
    if url.password is None:
        return uri, (pgpass_line(url, pgpassword) if pgpassword else None)
    # url.set(password=None) would keep it: _replace drops it
    return url._replace(password=None).render_as_string(hide_password=False), pgpass_line(
        url, url.password
    )


def _user_pgpass(environ) -> str:
    """The launcher's own password file (``PGPASSFILE``, else ``~/.pgpass``), read once, or ''."""
    path = environ.get("PGPASSFILE") or (
        Path(environ["HOME"]) / ".pgpass" if environ.get("HOME") else None
    )
    try:
        return Path(path).read_text() if path else ""
    except OSError:
        return ""


def write_private(path: Path, text: str) -> Path:
    """A new file readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_auth_config(
    folder: Path, cfg: ServerConfig, admin_user: str, auth_db: str | None = None
) -> Path:
    """The basic-auth ini; it holds no password (the auth database URI is given without one)."""
    text = (
        "[mlflow]\n"
        f"default_permission = {cfg.default_permission}\n"
        f"database_uri = {auth_db or cfg.auth_db()}\n"
        f"admin_username = {admin_user}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Each request's password check is a deliberately slow PBKDF2 hash (about a second
        # of CPU); workers logging every epoch would queue behind it. A verified password
        # is remembered this long per server worker (a changed password may still work
        # on another worker until then).
        f"auth_cache_ttl_seconds = {AUTH_CACHE_SECONDS}\n"
    )
    return write_private(Path(folder) / "basic_auth.ini", text)


def ensure_admin(auth_db_uri: str, user: str, password: str) -> bool:
    """Create the admin account in the users database unless it exists; True when created.

    Done here, before the server starts, so that the server never needs the admin password.
    """
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    store.init_db(auth_db_uri)  # creates or upgrades MLflow's users tables
    if store.has_user(user, use_primary=True):
        return False
    store.create_user(user, password, is_admin=True)
    return True


def server_command(cfg: ServerConfig, python: str = sys.executable) -> list[str]:
    """``mlflow server`` arguments; the backend store URI goes through the environment instead."""
    cmd = [
        python,
        "-m",
        "mlflow",
        "server",
        "--serve-artifacts",
        "--artifacts-destination",
        cfg.artifacts_destination,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--workers",
        str(cfg.workers),
    ]
    if cfg.auth:
        cmd += ["--app-name", "basic-auth"]
    if cfg.allowed_hosts:
        cmd += ["--allowed-hosts", cfg.allowed_hosts]
    if cfg.cors_allowed_origins:
        cmd += ["--cors-allowed-origins", cfg.cors_allowed_origins]
    return cmd


@contextlib.contextmanager
def prepared_server(
    cfg: ServerConfig,
    admin_user: str | None = None,
    admin_password: str | None = None,
    base_env: dict | None = None,
    folder: Path | None = None,
) -> Iterator[tuple[list[str], dict]]:
    """Yield ``(command, environment)`` of the server; its private files are deleted afterwards.

    ``folder``: the private runtime folder to write them into (default: a new one).

    Raises:
        ServerConfigError: Missing or unacceptable admin credentials (with auth on).
    """
    from tracking.server.server_process import new_runtime_dir, remove_runtime_dir

    if cfg.auth:
        check_admin_credentials(admin_user, admin_password)
    from tracking.store.storage_guard import refuse_optuna_database

    for what, uri in ((BACKEND_ENV, cfg.backend_store_uri), (AUTH_DB_ENV, cfg.auth_db())):
        try:  # before MLflow creates a table in either (the launcher creates the users tables below)
            refuse_optuna_database(uri, what)
        except ValueError as err:
            raise ServerConfigError(str(err)) from None
    source = os.environ if base_env is None else base_env
    # an allow-list: an unrelated DBPASS=... in the launcher's shell stays there
    env = server_env(source)
    folder = Path(folder) if folder is not None else new_runtime_dir()
    try:
        backend, backend_pass = split_password(cfg.backend_store_uri, source.get("PGPASSWORD"))
        auth_db, auth_pass = split_password(cfg.auth_db(), source.get("PGPASSWORD"))
        env["MLFLOW_BACKEND_STORE_URI"] = backend
        lines = [line for line in dict.fromkeys((backend_pass, auth_pass)) if line]
        if (
            lines
        ):  # libpq takes the first line that matches: the launcher's own file follows for the rest
            text = "\n".join(lines) + "\n" + _user_pgpass(source)
            env["PGPASSFILE"] = str(write_private(folder / ".pgpass", text))
        elif source.get("PGPASSFILE"):
            env["PGPASSFILE"] = source["PGPASSFILE"]
        # MLflow's job runner starts processes in sessions of their own, out of reach of the
        # server's process group; the workbench uses no MLflow jobs.
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        # after the user's own filters: it wins over them
        quiet = f"ignore:{':'.join(_STARLETTE_WSGI)}"
        env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), quiet) if w)
        if cfg.auth:
            ensure_admin(cfg.auth_db(), admin_user, admin_password)
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(
                write_auth_config(folder, cfg, admin_user, auth_db)
            )
            # CSRF tokens must verify across workers and restarts: a key per launch would
            # log UI users out on every restart, so a key set by the operator wins.
            env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secrets.token_hex(32))
        yield server_command(cfg), env
    finally:
        remove_runtime_dir(folder)


def describe(cfg: ServerConfig) -> str:
    """What is being served, safe to print (URIs redacted)."""
    parts = [
        f"MLflow server on {cfg.url()}",
        f"backend {redact_uri(cfg.backend_store_uri)}",
        f"artifacts proxied to {redact_uri(cfg.artifacts_destination)}",
    ]
    if cfg.auth:
        parts.append(
            f"basic-auth on (users in {redact_uri(cfg.auth_db())}, default permission {cfg.default_permission})"
        )
    else:
        parts.append("auth OFF")
    if cfg.allowed_hosts:
        parts.append(f"allowed hosts {cfg.allowed_hosts}")
    return "; ".join(parts)
