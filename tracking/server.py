"""The shared MLflow tracking server: PostgreSQL backend store, proxied artifacts, basic-auth.

Remote GPU workers (a Colab T4, a cluster node) log to it over HTTP(S) with
MLFLOW_TRACKING_URI / MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. The launcher
builds the ``mlflow server`` command and its environment:

- the backend store URI travels in MLFLOW_BACKEND_STORE_URI, not on the command line,
  so a database password does not show in ``ps``;
- artifacts are proxied (``--serve-artifacts --artifacts-destination``): workers need
  no storage credentials of their own;
- basic-auth reads an ini written to a private temporary file (mode 0600, removed when
  the server stops) that holds no password: the admin password reaches MLflow only
  through MLFLOW_AUTH_ADMIN_PASSWORD in the server's own environment;
- ``--allowed-hosts`` / ``--cors-allowed-origins`` must name the public host when the
  server sits behind a tunnel or reverse proxy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tracking.offline_fallback import redact_uri

ADMIN_USER_ENV = "WORKBENCH_SERVER_ADMIN_USER"
ADMIN_PASSWORD_ENV = "WORKBENCH_SERVER_ADMIN_PASSWORD"
BACKEND_ENV = "WORKBENCH_SERVER_BACKEND_URI"
ARTIFACTS_ENV = "WORKBENCH_SERVER_ARTIFACTS"
AUTH_DB_ENV = "WORKBENCH_SERVER_AUTH_DB_URI"
# The admin password older MLflow versions shipped in basic_auth.ini (GHSA-gq3w-7jj3-x7gr).
LEGACY_DEFAULT_PASSWORD = "password1234"
MIN_PASSWORD = 12  # MLflow's own minimum for basic-auth passwords
PERMISSIONS = ("READ", "EDIT", "MANAGE", "NO_PERMISSIONS")
AUTH_CACHE_SECONDS = 60


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
        default_permission: What every user may do on experiments others created. EDIT lets
            the workers of a team log cells into a protocol experiment someone else started.
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
    default_permission: str = "EDIT"
    allowed_hosts: str | None = None
    cors_allowed_origins: str | None = None

    def __post_init__(self) -> None:
        if not self.backend_store_uri:
            raise ServerConfigError(f"no backend store: pass --backend-store-uri or set {BACKEND_ENV}")
        if not self.artifacts_destination:
            raise ServerConfigError(f"no artifact destination: pass --artifacts-destination or set {ARTIFACTS_ENV}")
        if self.default_permission not in PERMISSIONS:
            raise ServerConfigError(f"default permission {self.default_permission!r}: one of {', '.join(PERMISSIONS)}")
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
        raise ServerConfigError(f"set {ADMIN_PASSWORD_ENV} to the admin password (at least {MIN_PASSWORD} characters)")
    if password == LEGACY_DEFAULT_PASSWORD:
        raise ServerConfigError(f"{ADMIN_PASSWORD_ENV} is MLflow's old published default admin password; choose another")
    if len(password) < MIN_PASSWORD:
        raise ServerConfigError(f"{ADMIN_PASSWORD_ENV} is shorter than {MIN_PASSWORD} characters")
    if password == user or password.lower() in (user.lower() * 3, "admin" * 3):
        raise ServerConfigError(f"{ADMIN_PASSWORD_ENV} must not be derived from the user name")


def write_auth_config(folder: Path, cfg: ServerConfig, admin_user: str) -> Path:
    """The basic-auth ini, readable by this user only; it holds no password."""
    path = Path(folder) / "basic_auth.ini"
    text = (
        "[mlflow]\n"
        f"default_permission = {cfg.default_permission}\n"
        f"database_uri = {cfg.auth_db()}\n"
        f"admin_username = {admin_user}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Each request's password check is a deliberately slow PBKDF2 hash (about a second
        # of CPU); workers logging every epoch would queue behind it. A verified password
        # is remembered this long per server worker (a changed password may still work
        # on another worker until then).
        f"auth_cache_ttl_seconds = {AUTH_CACHE_SECONDS}\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def server_command(cfg: ServerConfig, python: str = sys.executable) -> list[str]:
    """``mlflow server`` arguments; the backend store URI goes through the environment instead."""
    cmd = [python, "-m", "mlflow", "server", "--serve-artifacts", "--artifacts-destination", cfg.artifacts_destination,
           "--host", cfg.host, "--port", str(cfg.port), "--workers", str(cfg.workers)]
    if cfg.auth:
        cmd += ["--app-name", "basic-auth"]
    if cfg.allowed_hosts:
        cmd += ["--allowed-hosts", cfg.allowed_hosts]
    if cfg.cors_allowed_origins:
        cmd += ["--cors-allowed-origins", cfg.cors_allowed_origins]
    return cmd


@contextlib.contextmanager
def prepared_server(cfg: ServerConfig, admin_user: str | None = None, admin_password: str | None = None,
                    base_env: dict | None = None) -> Iterator[tuple[list[str], dict]]:
    """Yield ``(command, environment)`` of the server; the auth ini is deleted afterwards.

    Raises:
        ServerConfigError: Missing or unacceptable admin credentials (with auth on).
    """
    env = dict(os.environ if base_env is None else base_env)
    env["MLFLOW_BACKEND_STORE_URI"] = cfg.backend_store_uri
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(key, None)  # client settings of this shell have no business in the server
    folder = Path(tempfile.mkdtemp(prefix="workbench-server-"))  # mode 0700
    try:
        if cfg.auth:
            check_admin_credentials(admin_user, admin_password)
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(write_auth_config(folder, cfg, admin_user))
            env["MLFLOW_AUTH_ADMIN_USERNAME"] = admin_user
            env["MLFLOW_AUTH_ADMIN_PASSWORD"] = admin_password  # used once, to create the admin
            # CSRF tokens must verify across workers and restarts: a key per launch would
            # log UI users out on every restart, so a key set by the operator wins.
            env.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secrets.token_hex(32))
        yield server_command(cfg), env
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def describe(cfg: ServerConfig) -> str:
    """What is being started, safe to print (URIs redacted)."""
    parts = [f"MLflow server on {cfg.url()}", f"backend {redact_uri(cfg.backend_store_uri)}",
             f"artifacts proxied to {redact_uri(cfg.artifacts_destination)}"]
    if cfg.auth:
        parts.append(f"basic-auth (users in {redact_uri(cfg.auth_db())}, default permission {cfg.default_permission})")
    if cfg.allowed_hosts:
        parts.append(f"allowed hosts {cfg.allowed_hosts}")
    return "; ".join(parts)


def run_server(cfg: ServerConfig, admin_user: str | None, admin_password: str | None) -> int:
    """Run the server in the foreground until it exits or this process is told to stop."""
    with prepared_server(cfg, admin_user, admin_password) as (cmd, env):
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)

        def forward(signum, _frame):  # stop the whole server (it has worker processes)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return proc.wait()
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def _credentials(user: str, password: str):
    """MLflow's auth client reads credentials from the environment; lend it the admin's for one call."""
    keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict(zip(keys, (user, password))))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def add_user(tracking_uri: str, username: str, password: str, admin_user: str, admin_password: str,
             make_admin: bool = False) -> None:
    """Create a basic-auth user through the server's REST API (as the admin).

    Raises:
        ServerConfigError: A password MLflow would refuse, or the user exists already.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    if len(password) < MIN_PASSWORD:
        raise ServerConfigError(f"the password of {username!r} is shorter than {MIN_PASSWORD} characters")
    with _credentials(admin_user, admin_password):
        client = get_app_client("basic-auth", tracking_uri=tracking_uri)
        try:
            client.create_user(username, password)
            if make_admin:
                client.update_user_admin(username, True)
        except MlflowException as err:
            if err.get_http_status_code() in (401, 403):
                raise ServerConfigError(f"{redact_uri(tracking_uri)} refused the admin credentials "
                                        f"({ADMIN_USER_ENV} / {ADMIN_PASSWORD_ENV})") from None
            raise ServerConfigError(f"could not create user {username!r}: {err.message}") from None
