"""Entry point: a protocol's report (tables, seed-paired comparisons, figures) from MLflow runs."""

from __future__ import annotations

from pathlib import Path

import click

from reports.build import DEFAULT_OUT_ROOT, build_report, parse_compare
from reports.collect import ReportError
from reports.tables import BOOTSTRAP_RESAMPLES
from studies.protocol import ProtocolError
from tracking.queries import QueryError


@click.command("report")
@click.option("--protocol", "protocol", required=True,
              help="Protocol YAML file, or a protocol name (studies/protocols/<name>.yaml, else as logged in MLflow).")
@click.option("--hash", "hash_prefix", default=None,
              help="Report this recorded protocol hash (or unique prefix) instead of the file's.")
@click.option("--commit", default=None,
              help="Use only runs made at this code commit (prefix). Default: the newest finished run of each cell.")
@click.option("--compare", multiple=True, metavar="A:B",
              help="Also compare arm A against arm B (every arm is compared with the reference anyway). Repeatable.")
@click.option("--out-dir", "out_root", type=click.Path(file_okay=False), default=str(DEFAULT_OUT_ROOT), show_default=True,
              help="The report is written to OUT_DIR/<protocol name>/.")
@click.option("--resamples", type=click.IntRange(min=100), default=BOOTSTRAP_RESAMPLES, show_default=True,
              help="Bootstrap resamples.")
@click.option("--log/--no-log", default=True, show_default=True,
              help="Log the report as an artifact of the protocol's newest parent run.")
def report(protocol, hash_prefix, commit, compare, out_root, resamples, log):
    """Build reports/<protocol>/report.md and report.html from the protocol's finished MLflow runs."""
    transfer_file = _transfer_protocol_file(protocol)
    if transfer_file is not None:
        _transfer_report(transfer_file, Path(out_root), hash_prefix, resamples)
        return
    try:
        result = build_report(protocol, Path(out_root), hash_prefix, commit, parse_compare(compare), resamples, log)
    except (ReportError, ProtocolError, QueryError) as err:
        raise click.ClickException(str(err)) from err
    for message in result.messages:
        click.echo(message)
    click.echo(f"wrote {result.markdown}, {result.html} and {len(result.figures)} figures in {result.folder / 'figures'}")


def _transfer_protocol_file(protocol: str) -> Path | None:
    """The file of a transfer protocol (it has ``regimes``), or None for an ablation protocol."""
    import yaml

    path = Path(protocol)
    if not path.is_file():
        path = Path("studies/protocols") / f"{protocol}.yaml"
    try:
        content = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None
    return path if isinstance(content, dict) and "regimes" in content else None


def _transfer_report(path: Path, out_root: Path, hash_prefix: str | None, resamples: int) -> None:
    """The transfer section (kappa table with CIs, paired regime comparisons) as Markdown and HTML."""
    import html

    from tracking.transfer import transfer_section
    from workbench.convert.checkpoints import atomic_write_bytes

    name = path.stem
    try:
        section = transfer_section(name, protocol_hash=hash_prefix, n_resamples=resamples)
    except (LookupError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    folder = out_root / name
    atomic_write_bytes(folder / "report.md", section.markdown.encode("utf-8"))
    tables = "".join(
        f"<h2>{html.escape(title)}</h2>" + frame.to_html(index=False, float_format=lambda v: f"{v:.4f}", border=0)
        for title, frame in (("Regimes over seeds", section.summary), ("Kappa table (per seed, 95% CIs)", section.kappa_table),
                             ("Paired regime comparisons", section.comparisons))
    )
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)} transfer report</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
            "td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}</style></head><body>"
            f"<h1>{html.escape(name)}: transfer report</h1><pre>{html.escape(section.markdown)}</pre>{tables}</body></html>")
    atomic_write_bytes(folder / "report.html", page.encode("utf-8"))
    click.echo(f"wrote {folder / 'report.md'} and {folder / 'report.html'} (transfer protocol {name})")
