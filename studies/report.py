"""Entry point: a protocol's report (tables, paired comparisons, figures) from MLflow runs, for every protocol kind."""

from __future__ import annotations

from pathlib import Path

import click

from reports.build import DEFAULT_OUT_ROOT, build_report, parse_compare
from reports.collect import ReportError
from reports.tables import BOOTSTRAP_RESAMPLES
from tracking.queries import QueryError
from workbench.protocol import ProtocolError


@click.command("report")
@click.option("--protocol", "protocol", required=True,
              help="Protocol YAML file, or a protocol name (studies/protocols/<name>.yaml, else as logged in MLflow).")
@click.option("--hash", "hash_prefix", default=None,
              help="Report this recorded protocol hash (or unique prefix) instead of the file's.")
@click.option("--commit", default=None,
              help="Use only runs made at this code commit (prefix). Default: the newest finished run of each cell. "
                   "Ablation protocols only.")
@click.option("--compare", multiple=True, metavar="A:B",
              help="Also compare arm A against arm B (every arm is compared with the reference anyway). Repeatable. "
                   "Ablation protocols only (transfer reports compare every pair of regimes).")
@click.option("--out-dir", "out_root", type=click.Path(file_okay=False), default=str(DEFAULT_OUT_ROOT), show_default=True,
              help="The report is written to OUT_DIR/<protocol name>/.")
@click.option("--resamples", type=click.IntRange(min=100), default=BOOTSTRAP_RESAMPLES, show_default=True,
              help="Bootstrap resamples.")
@click.option("--log/--no-log", default=True, show_default=True,
              help="Log the report as an artifact of the protocol's newest parent run.")
def report(protocol, hash_prefix, commit, compare, out_root, resamples, log):
    """Build reports/<protocol>/report.md and report.html from the protocol's finished MLflow runs.

    Ablation and transfer protocols alike (the kind is read from the protocol file).
    """
    try:
        result = build_report(protocol, Path(out_root), hash_prefix, commit, parse_compare(compare), resamples, log)
    except (ReportError, ProtocolError, QueryError) as err:
        raise click.ClickException(str(err)) from err
    for message in result.messages:
        click.echo(message)
    click.echo(f"wrote {result.markdown}, {result.html} and {len(result.figures)} figures in {result.folder / 'figures'}")
