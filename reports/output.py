"""The files of a report and where they are logged: shared by every kind of report.

``write_report`` writes the figures, ``report.md`` and ``report.html`` of one report (0666 masked
by the umask: 0644 under umask 022, so the group can read them) and removes figures a previous
build left behind; ``log_report`` logs the folder to the protocol's parent run and to the
``mlflow run`` launcher run. ``ReportResult`` is what a build returns to the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reports import tables
from reports.collect import StudyData
from reports.render import Figure, to_html, to_markdown
from tracking.record import queries
from workbench.atomic import atomic_write_bytes
from workbench.transfer.report import TransferSection

REPORT_FILE_MODE = 0o666  # masked by the umask like any file open() creates: 0644 (group-readable) under umask 022


@dataclass
class ReportResult:
    """Where the report went and the numbers in it (for callers and tests)."""

    folder: Path
    markdown: Path
    html: Path
    figures: list[Path]
    study: StudyData | None = None  # ablation protocols
    summaries: dict[str, list[tables.ArmSummary]] = field(default_factory=dict)
    comparisons: dict[str, list[tables.Comparison]] = field(default_factory=dict)
    logged_to: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # what the command line should print
    section: TransferSection | None = None  # transfer protocols
    problems: list[str] = field(default_factory=list)  # missing cells and stale runs: `--strict` exits 1 on any


def log_report(result: ReportResult, folder: Path, targets: list[str] | None) -> None:
    """Log the report files to ``targets`` and to the ``mlflow run`` launcher run; ``None``: --no-log."""
    if targets is None:
        return
    launcher = queries.launcher_run_id()  # `mlflow run -e report` wraps this process in a run: it gets a copy
    for run_id in targets + ([launcher] if launcher and launcher not in targets else []):
        queries.log_report(run_id, folder)
        result.logged_to.append(run_id)
        result.messages.append(f"logged the report to run {run_id} (artifacts report/)")


def write_report(folder: Path, blocks: list, title: str) -> list[Path]:
    """Write figures, then the Markdown and HTML; drop figures a previous build left behind."""
    figures_dir = folder / "figures"
    written = []
    for block in blocks:
        if isinstance(block, Figure):
            path = figures_dir / block.filename
            atomic_write_bytes(path, block.png, REPORT_FILE_MODE)
            written.append(path)
    for stale in sorted(figures_dir.glob("*.png")) if figures_dir.is_dir() else []:
        if stale not in written:
            stale.unlink()  # e.g. a test-split figure of a protocol version that no longer evaluates test
    atomic_write_bytes(folder / "report.md", to_markdown(blocks).encode("utf-8"), REPORT_FILE_MODE)
    atomic_write_bytes(folder / "report.html", to_html(blocks, title).encode("utf-8"), REPORT_FILE_MODE)
    return written
