"""Entry point: a protocol's report (tables, paired comparisons, figures) from MLflow runs, for every protocol kind."""

from __future__ import annotations

from pathlib import Path

import click

from reports.build import (
    DEFAULT_OUT_ROOT,
    build_from_evidence,
    build_report,
    parse_compare,
    parse_interactions,
)
from reports.collect import ReportError
from reports.index import build_all
from reports.tables import BOOTSTRAP_RESAMPLES
from tracking.record.queries import QueryError
from workbench.protocol import ProtocolError
from workbench.sample import MIN_PER_CLASS


@click.command("report")
@click.option(
    "--protocol",
    "protocol",
    default=None,
    help="Protocol YAML file, or a protocol name (studies/protocols/<name>.yaml, else as logged in MLflow).",
)
@click.option(
    "--all",
    "all_protocols",
    is_flag=True,
    help="Report every protocol executed against the tracking store (its newest hash) and write "
    "OUT_DIR/index.html and index.md linking them, with each protocol's status.",
)
@click.option(
    "--hash",
    "hash_prefix",
    default=None,
    help="Report this recorded protocol hash (or unique prefix) instead of the file's.",
)
@click.option(
    "--commit",
    default=None,
    help="Use only runs made at this code commit (prefix). Default: the newest finished run of each cell. "
    "Ablation protocols only.",
)
@click.option(
    "--compare",
    multiple=True,
    metavar="A:B",
    help="Also compare arm A against arm B. Repeatable. Ablation protocols (every arm is compared with the "
    "reference anyway) and attribution protocols (each method's faithfulness, token norms and CLS attention "
    "of two acted-on arms, paired by seed and image); transfer reports compare every pair of regimes, "
    "intervention reports refuse it.",
)
@click.option(
    "--interaction",
    "interactions",
    multiple=True,
    metavar="A:B:C:D",
    help="Also report the interaction (A - B) - (C - D) per seed (e.g. what a recipe adds to one model minus "
    "what it adds to another), with its t-interval over seeds and the hierarchical bootstrap. Four "
    "different arms; repeatable. Ablation protocols only.",
)
@click.option(
    "--out-dir",
    "out_root",
    type=click.Path(file_okay=False),
    default=str(DEFAULT_OUT_ROOT),
    show_default=True,
    help="The report is written to OUT_DIR/<protocol name>/.",
)
@click.option(
    "--resamples",
    type=click.IntRange(min=100),
    default=BOOTSTRAP_RESAMPLES,
    show_default=True,
    help="Bootstrap resamples.",
)
@click.option(
    "--log/--no-log",
    default=True,
    show_default=True,
    help="Log the report as an artifact of the protocol's newest parent run.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 (after writing the report) when a cell has no finished run or a reported run is stale "
    "(a newer FAILED, KILLED or RUNNING attempt of its cell exists), or an attribution study's scored "
    f"images miss a class of the data or hold fewer than {MIN_PER_CLASS} of one.",
)
@click.option(
    "--evidence",
    is_flag=True,
    help="Also export the study's evidence to OUT_DIR/<protocol>/evidence/: every cell run's record and "
    "the reported runs' per-example predictions (intervention protocols: per-example outcomes of every "
    "intervention and the attention maps; attribution protocols: every cell's per-image arrays; transfer "
    "protocols: the execution's source and settings, every cell's logged val and test predictions and "
    "curves), enough to rebuild the report without the store. Every protocol kind.",
)
@click.option(
    "--from-evidence",
    "from_evidence",
    type=click.Path(file_okay=False),
    default=None,
    help="Rebuild a report from an evidence export (a folder written by --evidence) instead of the "
    "MLflow store, with the options it was built with; writes OUT_DIR/<protocol>/, logs nothing.",
)
@click.pass_context
def report(
    ctx,
    protocol,
    all_protocols,
    hash_prefix,
    commit,
    compare,
    interactions,
    out_root,
    resamples,
    log,
    strict,
    evidence,
    from_evidence,
):
    """Build reports/<protocol>/report.md and report.html from the protocol's finished MLflow runs.

    Ablation and transfer protocols alike (the kind is read from the protocol file).
    """
    if from_evidence:
        _from_evidence(ctx, Path(from_evidence), Path(out_root))
        return
    if all_protocols:
        if evidence:
            raise click.UsageError("--evidence applies to one protocol: give --protocol")
        for name, value in (
            ("--protocol", protocol),
            ("--hash", hash_prefix),
            ("--commit", commit),
            ("--compare", compare),
            ("--interaction", interactions),
        ):
            if value:
                raise click.UsageError(
                    f"{name} applies to one protocol; --all reports each protocol's newest hash"
                )
        try:
            entries, index = build_all(
                build_report, Path(out_root), n_resamples=resamples, log=log, strict=strict
            )
        except QueryError as err:
            raise click.ClickException(str(err)) from err
        for e in entries:
            click.echo(
                f"{e.entry.name}@{e.entry.newest_hash[:12]}: {e.outcome}"
                + (f" ({e.problems} missing or stale)" if e.problems else "")
            )
        click.echo(f"wrote {index} ({len(entries)} protocols)")
        if strict and any(e.problems or e.outcome != "built" for e in entries):
            raise SystemExit(1)
        return
    if not protocol:
        raise click.UsageError("give --protocol FILE_OR_NAME, or --all")
    try:
        result = build_report(
            protocol,
            Path(out_root),
            hash_prefix,
            commit,
            parse_compare(compare),
            resamples,
            log,
            strict,
            evidence,
            interactions=parse_interactions(interactions),
        )
    except (ReportError, ProtocolError, QueryError) as err:
        raise click.ClickException(str(err)) from err
    for message in result.messages:
        click.echo(message)
    click.echo(
        f"wrote {result.markdown}, {result.html} and {len(result.figures)} figures in {result.folder / 'figures'}"
    )
    if strict and result.problems:
        for problem in result.problems:
            click.echo(f"strict: {problem}", err=True)
        click.echo(
            f"--strict: {len(result.problems)} missing cell(s), stale run(s) or thin sample(s); exit 1",
            err=True,
        )
        raise SystemExit(1)


# What --from-evidence refuses beside it: the export holds the protocol, the runs and the build options.
NOT_WITH_EVIDENCE = {
    "protocol": "--protocol",
    "all_protocols": "--all",
    "hash_prefix": "--hash",
    "commit": "--commit",
    "compare": "--compare",
    "interactions": "--interaction",
    "resamples": "--resamples",
    "log": "--log/--no-log",
    "strict": "--strict",
    "evidence": "--evidence",
}


def _from_evidence(ctx: click.Context, folder: Path, out_root: Path) -> None:
    given = [
        option
        for name, option in NOT_WITH_EVIDENCE.items()
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
    ]
    if given:
        raise click.UsageError(
            f"{', '.join(given)}: not with --from-evidence (the export holds the protocol, the runs "
            "and the options the report was built with)"
        )
    try:
        result = build_from_evidence(folder, out_root)
    except ReportError as err:
        raise click.ClickException(str(err)) from err
    for message in result.messages:
        click.echo(message)
    click.echo(
        f"wrote {result.markdown}, {result.html} and {len(result.figures)} figures in {result.folder / 'figures'}"
    )
