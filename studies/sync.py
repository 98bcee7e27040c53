"""`workbench sync`: copy runs logged locally while the tracking server was away onto the server."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("sync")
@click.option("--from", "source", default=None,
              help="Local store holding the runs (default: the fallback store, $WORKBENCH_OFFLINE_DIR/mlflow.db).")
@click.option("--to", "target", default=None, help="Tracking server (default: $MLFLOW_TRACKING_URI).")
@click.option("--recheck", is_flag=True, help="Compare runs marked synced with the server again (copies only what is missing).")
@click.option("--dry-run", is_flag=True, help="List each local run, where it would go and how; copy nothing.")
def sync(source, target, recheck, dry_run):
    """Copy offline runs to the server: params, metric histories, tags, artifacts, models, parents; exactly once.

    Safe to run again at any time: what the server already has is not copied twice, and a
    run still running locally is copied as far as it got and completed by a later sync.
    "Synced" is remembered per target (server URL and experiment): a sync to another
    store copies again.
    """
    # Imported here so that `workbench sync --help` does not pay for importing MLflow.
    from tracking.offline_fallback import (TrackingAuthError, check_server, fallback_uri, is_remote, is_unreachable,
                                           raise_if_auth_failure, redact_uri, tracking_uri)
    from tracking.sync import plan as plan_sync
    from tracking.sync import sync as sync_runs

    source = source or fallback_uri()
    target = target or tracking_uri()
    if source.startswith("sqlite:///") and not Path(source.removeprefix("sqlite:///")).exists():
        click.echo(f"no local runs: {redact_uri(source)} does not exist")
        return
    if is_remote(target):
        state = check_server(target)  # wrong credentials: TrackingAuthError, a clear message
        if state != "up":
            raise click.ClickException(f"{redact_uri(target)} unreachable ({state}); nothing copied, try again later")
    click.echo(f"sync {redact_uri(source)} -> {redact_uri(target)}{' (dry run: nothing is copied)' if dry_run else ''}")
    try:
        if dry_run:
            lines = plan_sync(source, target, recheck=recheck)
            for line in lines:
                click.echo(line)
            click.echo(f"{sum('already synced' not in line for line in lines)} of {len(lines)} runs would be copied or completed")
            return
        report = sync_runs(source, target, recheck=recheck, log=click.echo)
    except TrackingAuthError:
        raise
    except Exception as err:
        raise_if_auth_failure(target, err)
        if is_unreachable(err):
            raise click.ClickException(f"{redact_uri(target)} went away during the sync ({redact_uri(str(err))[:300]}); "
                                       "what was copied stays, run `workbench sync` again") from None
        raise
    click.echo(report.summary())
    for error in report.errors:
        click.echo(f"  ERROR {error}", err=True)
    if report.errors:
        raise SystemExit(1)
