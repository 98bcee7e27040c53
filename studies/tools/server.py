"""`workbench server`: run the shared MLflow tracking server, add its users, grant and revoke, check a connection."""

from __future__ import annotations

import os

import click

from studies.runtime.secret_options import DATABASE_INSTEAD, TRACKING_INSTEAD, warn_if_in_argv
from tracking.server import server_config, server_process, server_users
from tracking.store.health import check_server
from tracking.store.uris import redact_uri, tracking_uri

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.group("server")
def server() -> None:
    """Run and administer the shared MLflow tracking server (PostgreSQL, proxied artifacts, basic-auth)."""


@server.command("start")
@click.option(
    "--backend-store-uri",
    envvar=server_config.BACKEND_ENV,
    required=True,
    callback=warn_if_in_argv(DATABASE_INSTEAD),
    help=f"Runs database, e.g. postgresql://mlflow@127.0.0.1:5432/mlflow (env {server_config.BACKEND_ENV}).",
)
@click.option(
    "--artifacts-destination",
    envvar=server_config.ARTIFACTS_ENV,
    default="./mlartifacts",
    show_default=True,
    help=f"Where proxied artifacts are stored: a folder or s3://... (env {server_config.ARTIFACTS_ENV}).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface to bind; keep 127.0.0.1 behind a tunnel or reverse proxy.",
)
@click.option("--port", type=int, default=5000, show_default=True)
@click.option("--workers", type=int, default=2, show_default=True)
@click.option(
    "--auth/--no-auth",
    default=True,
    show_default=True,
    help="basic-auth (--no-auth only on loopback).",
)
@click.option(
    "--auth-db-uri",
    envvar=server_config.AUTH_DB_ENV,
    default=None,
    callback=warn_if_in_argv(DATABASE_INSTEAD),
    help=f"Users database, e.g. postgresql://mlflow@127.0.0.1/mlflow_auth (env {server_config.AUTH_DB_ENV}); "
    "default sqlite ./mlflow-auth.db.",
)
@click.option(
    "--default-permission",
    type=click.Choice(server_config.PERMISSIONS),
    default="READ",
    show_default=True,
    help="What users may do on experiments others created (give EDIT per experiment with `grant`).",
)
@click.option(
    "--allowed-hosts",
    default=None,
    help="Host headers to accept, e.g. mlflow.example.org (the tunnel's name).",
)
@click.option(
    "--cors-allowed-origins", default=None, help="Browser origins allowed to call the API."
)
def start(
    backend_store_uri,
    artifacts_destination,
    host,
    port,
    workers,
    auth,
    auth_db_uri,
    default_permission,
    allowed_hosts,
    cors_allowed_origins,
):
    """Start the tracking server in the foreground (Ctrl-C stops it).

    The admin account comes from WORKBENCH_SERVER_ADMIN_USER (default admin) and
    WORKBENCH_SERVER_ADMIN_PASSWORD; it is created on the first start. Prints one line
    when the server answers; exits 1 when the port is taken or the server dies first.
    """
    if not auth and host not in LOOPBACK:
        raise click.UsageError(
            f"--no-auth on {host}: anyone who reaches it could read and change every run; "
            "keep basic-auth on, or bind 127.0.0.1"
        )
    user = os.environ.get(server_config.ADMIN_USER_ENV, "admin")
    # read once; no child inherits it
    password = os.environ.pop(server_config.ADMIN_PASSWORD_ENV, None)
    try:
        cfg = server_config.ServerConfig(
            backend_store_uri,
            artifacts_destination,
            host,
            port,
            workers,
            auth,
            auth_db_uri,
            default_permission,
            allowed_hosts,
            cors_allowed_origins,
        )
        if auth:
            server_config.check_admin_credentials(user, password)
        server_process.check_port_free(cfg.host, cfg.port)
        folder = server_process.new_runtime_dir()
        with server_config.prepared_server(cfg, user, password, folder=folder) as (cmd, env):
            password = None
            code = server_process.run(
                cmd,
                env,
                cfg.url(),
                folder,
                on_ready=lambda: click.echo(f"ready: {server_config.describe(cfg)}"),
            )
    except (server_config.ServerConfigError, server_process.ServerStartError) as err:
        raise click.ClickException(str(err)) from None
    raise SystemExit(code)


def _admin() -> tuple[str, str]:
    admin, admin_password = (
        os.environ.get(server_config.ADMIN_USER_ENV, "admin"),
        os.environ.get(server_config.ADMIN_PASSWORD_ENV),
    )
    if not admin_password:
        raise click.ClickException(
            f"set {server_config.ADMIN_PASSWORD_ENV} (and {server_config.ADMIN_USER_ENV}) to the server's admin account"
        )
    return admin, admin_password


@server.command("add-user")
@click.argument("username")
@click.option(
    "--tracking-uri",
    envvar="MLFLOW_TRACKING_URI",
    required=True,
    callback=warn_if_in_argv(TRACKING_INSTEAD),
    help="The server (env MLFLOW_TRACKING_URI).",
)
@click.option(
    "--password-env",
    default=server_config.NEW_USER_PASSWORD_ENV,
    show_default=True,
    help="Name of the environment variable holding the new password (for scripts); "
    "prompted for (hidden) when it is unset.",
)
@click.option("--admin", "make_admin", is_flag=True, help="Make the user an admin.")
def add_user(username, tracking_uri, password_env, make_admin):
    """Create a user on a basic-auth server, as the admin (WORKBENCH_SERVER_ADMIN_USER / _PASSWORD).

    The new user may read every experiment and change the experiments it creates; give it
    EDIT on someone else's with `workbench server grant`.
    """
    password = os.environ.get(password_env) or click.prompt(
        f"password for {username}", hide_input=True, confirmation_prompt=True
    )
    admin, admin_password = _admin()
    try:
        server_users.add_user(tracking_uri, username, password, admin, admin_password, make_admin)
    except server_config.ServerConfigError as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"created user {username}{' (admin)' if make_admin else ''} on {redact_uri(tracking_uri)}"
    )


def _check_permission(_ctx, _param, value: str) -> str:
    try:
        return server_users.check_permission(value)
    except server_config.ServerConfigError as err:
        raise click.BadParameter(str(err)) from None


@server.command("grant")
@click.argument("username")
@click.argument("experiment")
@click.option(
    "--permission",
    default="EDIT",
    show_default=True,
    callback=_check_permission,
    help=f"One of {', '.join(server_users.GRANT_PERMISSIONS)}. EDIT: create runs, change any run, rename; "
    "MANAGE: also delete and grant; DENY: not even read. Replaces a grant the user has.",
)
@click.option(
    "--tracking-uri",
    envvar="MLFLOW_TRACKING_URI",
    required=True,
    callback=warn_if_in_argv(TRACKING_INSTEAD),
    help="The server (env MLFLOW_TRACKING_URI).",
)
def grant(username, experiment, permission, tracking_uri):
    """Give USERNAME a permission on EXPERIMENT (name or id), or change it, as the admin: e.g. a worker account EDIT."""
    admin, admin_password = _admin()
    try:
        done = server_users.grant(
            tracking_uri, username, experiment, permission, admin, admin_password
        )
    except server_config.ServerConfigError as err:
        raise click.ClickException(str(err)) from None
    change = (
        ""
        if done.before is None
        else " (unchanged)"
        if done.before == done.after
        else f" (was {done.before})"
    )
    click.echo(
        f"{username}: {permission} on experiment {experiment!r} (id {done.experiment_id}) on "
        f"{redact_uri(tracking_uri)}{change}"
    )
    if permission == "EDIT":
        click.echo(server_users.edit_warning(username, experiment), err=True)


@server.command("revoke")
@click.argument("username")
@click.argument("experiment")
@click.option(
    "--tracking-uri",
    envvar="MLFLOW_TRACKING_URI",
    required=True,
    callback=warn_if_in_argv(TRACKING_INSTEAD),
    help="The server (env MLFLOW_TRACKING_URI).",
)
def revoke(username, experiment, tracking_uri):
    """Remove USERNAME's grant on EXPERIMENT (name or id), as the admin: the server's default permission applies again."""
    admin, admin_password = _admin()
    try:
        done = server_users.revoke(tracking_uri, username, experiment, admin, admin_password)
    except server_config.ServerConfigError as err:
        raise click.ClickException(str(err)) from None
    click.echo(
        f"{username}: {done.before} on experiment {experiment!r} (id {done.experiment_id}) revoked on "
        f"{redact_uri(tracking_uri)}; {username} now has {done.effective} there"
    )


@server.command("check")
def check():
    """Probe MLFLOW_TRACKING_URI with the MLFLOW_TRACKING_USERNAME / _PASSWORD credentials."""
    uri = tracking_uri()
    # TrackingAuthError: exit 1
    state = check_server(uri) if uri.startswith(("http://", "https://")) else "up"
    if state != "up":
        raise click.ClickException(f"{redact_uri(uri)} unreachable: {state}")
    click.echo(f"{redact_uri(uri)}: reachable, credentials accepted")
