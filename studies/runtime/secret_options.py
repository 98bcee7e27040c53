"""Options that take a URL with credentials: from the environment or a file, never needed on argv.

``ps`` shows every process's command line to every user of the machine (PostgreSQL's own
rule: a password never goes on a command line). So each such option has a form that
keeps the URL, or at least its password, out of argv:

- the Optuna storage (``ablate``, ``worker``, ``sweep``): ``--storage-env VAR`` (the name
  of a variable holding the URL), ``WORKBENCH_STORAGE`` (``worker`` and ``sweep``; not
  ``ablate``, where the option decides between training here and queuing), and for
  PostgreSQL a URL without a password, which libpq completes from ``PGPASSWORD`` or the
  password file (``PGPASSFILE``, default ``~/.pgpass``);
- the tracking server (``--tracking-uri``, ``sync --to``): ``MLFLOW_TRACKING_URI`` with
  the account in ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` or MLflow's
  credentials file ``~/.mlflow/credentials``;
- the server's databases (``server start``): ``WORKBENCH_SERVER_BACKEND_URI`` /
  ``WORKBENCH_SERVER_AUTH_DB_URI``, or passwordless URIs with ``PGPASSWORD`` / ``.pgpass``.

A password given in argv anyway works, with one warning line (the URL redacted).
"""

from __future__ import annotations

import functools
from urllib.parse import parse_qsl, urlsplit

import click
from click.core import ParameterSource

from tracking.store.redact import is_secret_name, redact_text

STORAGE_ENV = "WORKBENCH_STORAGE"
_warned: set[str] = set()


def has_password(url: str) -> bool:
    """Whether ``url`` carries a secret: a password in its userinfo or a secret query parameter."""
    try:
        parts = urlsplit(url)
        return parts.password is not None or any(
            is_secret_name(k) for k, _ in parse_qsl(parts.query)
        )
    except ValueError:
        return False


def warn_password_in_argv(option: str, url: str, instead: str) -> None:
    """One line on stderr, once per option and process, when a password was typed on the command line."""
    if option in _warned or not has_password(url):
        return
    _warned.add(option)
    click.echo(
        f"warning: {option} {redact_text(url)} puts a password on the command line, where `ps` shows it to "
        f"every user of this machine; {instead}",
        err=True,
    )


def warn_if_in_argv(instead: str):
    """A click callback: ``warn_password_in_argv`` when the value came from the command line."""

    def callback(ctx: click.Context, param: click.Parameter, value):
        if value and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE:
            warn_password_in_argv(param.opts[0], value, instead)
        return value

    return callback


STORAGE_INSTEAD = (
    "pass --storage-env VAR (a variable holding the URL) instead, or leave the password out of the "
    "URL and let PostgreSQL read it from PGPASSWORD or ~/.pgpass (PGPASSFILE)"
)
TRACKING_INSTEAD = (
    "set MLFLOW_TRACKING_URI instead, with the account in MLFLOW_TRACKING_USERNAME / "
    "MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials"
)
DATABASE_INSTEAD = (
    "set WORKBENCH_SERVER_BACKEND_URI / WORKBENCH_SERVER_AUTH_DB_URI instead, or leave the password out "
    "of the URI and put it in ~/.pgpass (PGPASSFILE) or PGPASSWORD"
)


def resolve_storage(storage: str | None, storage_env: str | None, required: bool) -> str | None:
    """The storage URL from ``--storage-env VAR``, ``--storage`` or ``WORKBENCH_STORAGE`` (None when none).

    Raises:
        click.UsageError: both forms on the command line, or none where one is required.
        click.BadParameter: ``--storage-env`` names an unset or empty variable.
    """
    import os

    ctx = click.get_current_context(silent=True)
    typed = ctx is not None and ctx.get_parameter_source("storage") == ParameterSource.COMMANDLINE
    if storage_env:
        if typed:
            raise click.UsageError("give --storage or --storage-env, not both")
        value = os.environ.get(storage_env, "").strip()
        if not value:
            raise click.BadParameter(
                f"the variable {storage_env} is not set (or empty); export the storage URL in it",
                param_hint="'--storage-env'",
            )
        return value
    if not storage and required:
        raise click.UsageError(
            f"no Optuna storage: set {STORAGE_ENV} to its URL, or pass --storage-env VAR "
            "naming a variable that holds it (or --storage URL)"
        )
    return storage or None


def storage_options(*, required: bool, help: str, from_env: bool = True):
    """``--storage URL`` (also ``$WORKBENCH_STORAGE`` when ``from_env``) and ``--storage-env VAR``; the
    command gets ``storage``.

    ``from_env=False`` for ``ablate``: there the option switches from training here to
    queuing, which an exported variable must not do behind the user's back.
    """

    def decorate(command):
        @functools.wraps(command)
        def wrapped(*args, storage=None, storage_env=None, **kwargs):
            return command(*args, storage=resolve_storage(storage, storage_env, required), **kwargs)

        wrapped = click.option(
            "--storage-env",
            "storage_env",
            metavar="VAR",
            default=None,
            help="Name of an environment variable that holds the storage URL: the URL (and its password) stay "
            "off the command line.",
        )(wrapped)
        return click.option(
            "--storage",
            default=None,
            envvar=STORAGE_ENV if from_env else None,
            show_envvar=from_env,
            metavar="URL",
            callback=warn_if_in_argv(STORAGE_INSTEAD),
            help=f"{help} A PostgreSQL URL may leave its password out: libpq reads PGPASSWORD or ~/.pgpass "
            "(PGPASSFILE).",
        )(wrapped)

    return decorate


def worker_hint(storage: str, study: str) -> str:
    """How to start workers on the queue, with the storage URL kept out of their argv.

    The URL as this command got it: ``--storage-env VAR`` -> the same option; otherwise the
    URL goes into WORKBENCH_STORAGE, shown whole only when it holds no password.
    """
    import shlex

    ctx = click.get_current_context(silent=True)
    env_name = ctx.params.get("storage_env") if ctx is not None else None
    study = shlex.quote(study)
    if env_name:
        return (
            f"Start workers with {env_name} set to the storage URL ({redact_text(storage)}):\n"
            f"  workbench worker --storage-env {env_name} --study {study}"
        )
    if has_password(storage):
        return (
            f"Start workers with {STORAGE_ENV} set to the storage URL ({redact_text(storage)}; or that URL "
            "without its password, and the password in PGPASSWORD or ~/.pgpass):\n"
            f"  workbench worker --study {study}"
        )
    pg = " (the password from PGPASSWORD or ~/.pgpass)" if storage.startswith("postgresql") else ""
    return (
        f"Start workers with{pg}:\n"
        f"  {STORAGE_ENV}={shlex.quote(storage)} workbench worker --study {study}"
    )
