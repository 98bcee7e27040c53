"""Build a protocol's report: query MLflow, compute, render, write, log.

``build_report`` is the whole job behind ``workbench report``. The output folder
``<out_root>/<protocol name>/`` holds ``report.md``, ``report.html`` (self-contained) and
``figures/*.png``; the same files are logged under ``report/`` on the protocol's newest
parent run of the reported hash. Nothing in them depends on when or where the report was
built, only on the runs, so rebuilding from the same runs gives byte-identical files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from reports import document, tables
from reports.collect import ReportError, StudyData, load_study, resolve_protocol
from reports.render import Figure, to_html, to_markdown
from tracking import queries
from workbench.convert.checkpoints import atomic_write_bytes

DEFAULT_OUT_ROOT = Path("reports")


@dataclass
class ReportResult:
    """Where the report went and the numbers in it (for callers and tests)."""

    folder: Path
    markdown: Path
    html: Path
    figures: list[Path]
    study: StudyData
    summaries: dict[str, list[tables.ArmSummary]]
    comparisons: dict[str, list[tables.Comparison]]
    logged_to: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # what the command line should print


def parse_compare(values: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``["cnn:vit_small"]`` -> ``[("cnn", "vit_small")]``."""
    pairs = []
    for value in values:
        a, sep, b = value.partition(":")
        if not sep or not a or not b:
            raise ReportError(f"--compare {value!r}: expected ARM_A:ARM_B")
        pairs.append((a, b))
    return pairs


def build_report(
    protocol: str, out_root: Path = DEFAULT_OUT_ROOT, hash_prefix: str | None = None, commit: str | None = None,
    compare: list[tuple[str, str]] | None = None, n_resamples: int = tables.BOOTSTRAP_RESAMPLES, log: bool = True,
) -> ReportResult:
    """Build, write and (optionally) log the report of one protocol hash.

    Args:
        protocol: Protocol YAML path or protocol name.
        out_root: The report goes to ``out_root/<protocol name>/``.
        hash_prefix: Report this recorded hash instead of the protocol file's.
        commit: Use only runs of this code commit (prefix); default: newest finished run per cell.
        compare: Extra (a, b) arm pairs, beyond every arm against the reference.
        n_resamples: Bootstrap resamples.
        log: Log the report files to the newest parent run of the hash (and to the
            ``mlflow run`` launcher run when there is one).

    Raises:
        ReportError: Nothing to report, a bad option, or runs lacking what the report needs.
        tracking.queries.QueryError: The protocol was never run against this tracking store.
    """
    spec, counts = resolve_protocol(protocol, hash_prefix)
    study = load_study(spec, counts, commit)
    messages = [(f"{spec.name}@{spec.short_hash}: {len(study.cells)} of {len(spec.arms) * len(spec.seeds)} cells "
                 f"have a finished run ({spec.source})")]
    messages += [f"warning: {w}" for w in document.warning_items(study)]
    messages += [f"missing: {a}/seed{s} ({why})" for a, s, why in study.missing]
    if not study.cells:
        raise ReportError("\n".join(messages + [f"no finished cell runs of {spec.name}@{spec.short_hash}: nothing to report"]))
    try:
        pairs = tables.comparison_pairs(study, compare or [])
    except ValueError as err:
        raise ReportError(str(err)) from err
    summaries = {split: [tables.arm_summary(study, arm, split) for arm in spec.arms] for split in spec.splits}
    comparisons = {split: [tables.compare(study, a, b, split, n_resamples) for a, b in pairs] for split in spec.splits}
    log_targets = [study.parent_run_id] if log and study.parent_run_id else []
    if log and not study.parent_run_id:
        messages.append(f"no parent run of {spec.name}@{spec.short_hash} found: the report is not logged to MLflow")

    blocks = (document.header(study, n_resamples, log_targets) + document.accuracy_section(study, summaries)
              + document.comparison_section(study, comparisons, n_resamples) + document.per_class_section(study)
              + document.curves_section(study) + _analysis(spec) + document.runs_section(study))
    folder = Path(out_root) / spec.name
    figure_paths = _write(folder, blocks, f"{spec.name}@{spec.short_hash} report")
    result = ReportResult(folder, folder / "report.md", folder / "report.html", figure_paths, study, summaries, comparisons,
                          messages=messages)
    if log:
        launcher = queries.launcher_run_id()  # `mlflow run -e report` wraps this process in a run: it gets a copy
        for run_id in log_targets + ([launcher] if launcher and launcher not in log_targets else []):
            queries.log_report(run_id, folder)
            result.logged_to.append(run_id)
            messages.append(f"logged the report to run {run_id} (artifacts report/)")
    return result


def _analysis(spec) -> list:
    """Analysis figures logged by `workbench figures` on a parent run of this hash, if any."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return document.analysis_section(queries.analysis_figures(spec.name, spec.hash, Path(tmp)))


def _write(folder: Path, blocks: list, title: str) -> list[Path]:
    """Write figures, then the Markdown and HTML; drop figures a previous build left behind."""
    figures_dir = folder / "figures"
    written = []
    for block in blocks:
        if isinstance(block, Figure):
            path = figures_dir / block.filename
            atomic_write_bytes(path, block.png)
            written.append(path)
    for stale in sorted(figures_dir.glob("*.png")) if figures_dir.is_dir() else []:
        if stale not in written:
            stale.unlink()  # e.g. a test-split figure of a protocol version that no longer evaluates test
    atomic_write_bytes(folder / "report.md", to_markdown(blocks).encode("utf-8"))
    atomic_write_bytes(folder / "report.html", to_html(blocks, title).encode("utf-8"))
    return written

