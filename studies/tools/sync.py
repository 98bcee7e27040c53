"""`workbench sync`: copy runs logged locally while the tracking server was away onto the server."""

from __future__ import annotations

from pathlib import Path

import click

from studies.runtime.secret_options import TRACKING_INSTEAD, warn_if_in_argv


def local_store_uri(value: str) -> str:
    """``--from`` as an SQLite URL: a path to an SQLite file is taken as ``sqlite:///<path>``.

    Raises:
        click.BadParameter: the file does not exist, is not an SQLite database, or the value
            is neither an SQLite URL nor a path to one (MLflow would read a folder as a
            file store, which MLflow 3 refuses).
    """
    from tracking.store.storage_guard import check_sqlite_file, sqlite_file

    uri = value if "://" in value else f"sqlite:///{Path(value).expanduser().resolve()}"
    path = sqlite_file(uri)
    if path is None:
        raise click.BadParameter(
            f"{value}: not a local SQLite store; give sqlite:///path/to/mlflow.db or the path "
            "of the .db file",
            param_hint="'--from'",
        )
    if not path.is_file():
        raise click.BadParameter(
            f"{value}: {path} does not exist"
            if not path.exists()
            else f"{value}: {path} is a folder, not an SQLite database file",
            param_hint="'--from'",
        )
    try:
        check_sqlite_file(uri)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="'--from'") from err
    return uri


@click.command("sync")
@click.option(
    "--from",
    "source",
    default=None,
    help="Local store holding the runs: sqlite:///path or the path of the .db file "
    "(default: the fallback store, $WORKBENCH_OFFLINE_DIR/mlflow.db).",
)
@click.option(
    "--to",
    "target",
    default=None,
    callback=warn_if_in_argv(TRACKING_INSTEAD),
    help="Tracking server (default: $MLFLOW_TRACKING_URI; its account from MLFLOW_TRACKING_USERNAME / "
    "MLFLOW_TRACKING_PASSWORD or ~/.mlflow/credentials, never needed in the URL).",
)
@click.option(
    "--recheck",
    is_flag=True,
    help="Compare runs marked synced with the server again (copies only what is missing).",
)
@click.option(
    "--dry-run", is_flag=True, help="List each local run, where it would go and how; copy nothing."
)
def sync(source, target, recheck, dry_run):
    """Copy offline runs to the server: params, metric histories, tags, artifacts, models, parents; exactly once.

    Safe to run again at any time: what the server already has is not copied twice, and a
    run still running locally is copied as far as it got and completed by a later sync.
    "Synced" is remembered per target (server URL and experiment): a sync to another
    store copies again.
    """
    # Imported here so that `workbench sync --help` does not pay for importing MLflow.
    from tracking.store.health import (
        TrackingAuthError,
        check_server,
        is_unreachable,
        raise_if_auth_failure,
    )
    from tracking.store.offline_store import fallback_uri
    from tracking.store.uris import is_remote, redact_uri, tracking_uri
    from tracking.export.offline_sync import plan as plan_sync
    from tracking.export.offline_sync import sync as sync_runs

    if source is None:
        source = fallback_uri()
        if not Path(
            source.removeprefix("sqlite:///")
        ).exists():  # nothing was ever logged offline here
            click.echo(f"no local runs: {redact_uri(source)} does not exist")
            return
    else:
        source = local_store_uri(source)
    target = target or tracking_uri()
    if is_remote(target):
        state = check_server(target)  # wrong credentials: TrackingAuthError, a clear message
        if state != "up":
            raise click.ClickException(
                f"{redact_uri(target)} unreachable ({state}); nothing copied, try again later"
            )
    click.echo(
        f"sync {redact_uri(source)} -> {redact_uri(target)}{' (dry run: nothing is copied)' if dry_run else ''}"
    )
    try:
        if dry_run:
            lines = plan_sync(source, target, recheck=recheck)
            for line in lines:
                click.echo(line)
            click.echo(
                f"{sum('already synced' not in line for line in lines)} of {len(lines)} runs would be copied or completed"
            )
            return
        report = sync_runs(source, target, recheck=recheck, log=click.echo)
    except TrackingAuthError:
        raise
    except Exception as err:
        raise_if_auth_failure(target, err)
        if is_unreachable(err):
            raise click.ClickException(
                f"{redact_uri(target)} went away during the sync ({redact_uri(str(err))[:300]}); "
                "what was copied stays, run `workbench sync` again"
            ) from None
        raise
    click.echo(report.summary())
    for error in report.errors:
        click.echo(f"  ERROR {error}", err=True)
    if report.errors:
        raise SystemExit(1)
