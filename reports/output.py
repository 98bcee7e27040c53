"""The files of a report and where they are logged: shared by every kind of report.

``write_report`` writes the figures, ``report.md`` and ``report.html`` of one report (0666 masked
by the umask: 0644 under umask 022, so the group can read them) and removes figures a previous
build left behind; ``log_report`` logs the folder to the protocol's parent run and to the
``mlflow run`` launcher run. ``ReportResult`` is what a build returns to the command line.

What a report puts on its study's parent run besides the files: every comparison as metrics
and its Results in words (``Summary``). The text is the report's own Results section
(``results_text`` reads it from the rendered blocks: each stated result, the sentences on
heads, the caveats stated once), so the description in the MLflow UI says exactly what the
report says. An ablation report adds one row per arm (``ablation_arm_rows``: the arm's mean
accuracy with its 95% t-interval and its paired difference to the reference with its
interval, each as the report's tables state it), which ``log_arm_rows`` writes as summary
runs, with the view of the runs list that shows them. The metrics are keyed by
``tracking.record.report_summary.comparison_metrics``;
accuracy differences are in percentage points as in the report (transfer: QWK, accuracy or
macro-F1 differences as they are). ``tracking.record.report_summary.log_summary`` writes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from reports import tables
from reports.collect import ReportError, StudyData
from reports.render import Block, Bullets, Figure, Heading, Para, Quote, to_html, to_markdown
from tracking.record import queries, report_summary
from tracking.record.report_summary import HEAD, LIMIT, SEPARATOR, arm_metrics, comparison_metrics
from workbench.atomic import atomic_write_bytes
from workbench.estimates import mean_interval
from reports.content.rounding import fmt
from workbench.transfer.report import TransferSection

# masked by the umask like any file open() creates: 0644 (group-readable) under umask 022
REPORT_FILE_MODE = 0o666


@dataclass(frozen=True)
class ReportRequest:
    """What ``workbench report`` was asked, handed whole to the report builder of the protocol's kind.

    Each kind's builder (named by the table of kinds, ``workbench.kinds``) answers
    ``build(path, request)`` (the protocol file), ``by_name(name, request)`` (a protocol known only
    to the store: its report, or None when the store holds no study of this kind by that name),
    ``evidence_format`` and ``rebuild(evidence_dir, out_root)`` (from its evidence export alone).

    Attributes:
        protocol: The protocol as given: a file path or a protocol name.
        out_root: The report goes to ``out_root/<protocol name>/``.
        hash_prefix: Report this recorded hash instead of the protocol file's.
        commit: Use only runs of this code commit (prefix).
        compare: Extra (a, b) arm pairs.
        n_resamples: Bootstrap resamples.
        log: Log the report files to the newest parent run of the hash.
        strict: Recorded in the report's build inputs; the caller fails on ``problems``.
        evidence: Also export the study's evidence beside the report.
        interactions: (a, b, c, d) arm quadruples, (a - b) - (c - d); ablation protocols only.
    """

    protocol: str
    out_root: Path
    hash_prefix: str | None = None
    commit: str | None = None
    compare: tuple[tuple[str, str], ...] = ()
    n_resamples: int = tables.BOOTSTRAP_RESAMPLES
    log: bool = True
    strict: bool = False
    evidence: bool = False
    interactions: tuple[tuple[str, str, str, str], ...] = ()


def refuse_interactions(request: ReportRequest, article: str) -> None:
    """``--interaction`` is an ablation report's: refused in one line for ``article`` protocols."""
    if request.interactions:
        raise ReportError(
            f"--interaction: for ablation protocols; {request.protocol} is {article} protocol"
        )


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
    # split -> (a - b) - (c - d)
    interactions: dict[str, list[tables.Interaction]] = field(default_factory=dict)
    # split -> reports.data_size.size_reading.SizeReading, where the arms vary train_subset
    data_size: dict = field(default_factory=dict)
    logged_to: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # what the command line should print
    section: TransferSection | None = None  # transfer protocols
    # missing cells and stale runs: `--strict` exits 1 on any
    problems: list[str] = field(default_factory=list)
    # what the parent run gets besides the files: comparisons as metrics, Results as text
    summary: Summary | None = None


def log_report(result: ReportResult, folder: Path, targets: list[str] | None) -> None:
    """Log the report files to ``targets`` and to the ``mlflow run`` launcher run; ``None``: --no-log."""
    if targets is None:
        return
    # `mlflow run -e report` wraps this process in a run: it gets a copy
    launcher = queries.launcher_run_id()
    for run_id in targets + ([launcher] if launcher and launcher not in targets else []):
        queries.log_report(run_id, folder)
        result.logged_to.append(run_id)
        result.messages.append(f"logged the report to run {run_id} (artifacts report/)")
    for run_id in (
        targets if result.summary is not None else []
    ):  # the study's parent: its answer in the UI
        stale, page = report_summary.log_summary(
            run_id, result.summary.metrics, result.summary.text
        )
        result.messages.append(
            f"run {run_id}: the report's {result.summary.comparisons} comparisons as metrics (cmp.*) and its results "
            "as the description"
            + (f"; {stale} comparison(s) no longer made set to NaN" if stale else "")
            + (f"; in the MLflow UI: {page}" if page else "")
        )
        if result.summary.arms:
            arms = result.summary.arms
            dropped, view = report_summary.log_arm_rows(
                run_id, arms.rows, arms.reference, arms.notes, arms.split
            )
            result.messages.append(
                f"one summary run per arm ({len(arms.rows)}: mean, 95% interval, difference to "
                f"{arms.reference}) beside run {run_id}"
                + (f"; {dropped} arm(s) no longer reported set to NaN" if dropped else "")
                + (f"; the runs list showing them: {view}" if view else "")
            )


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
    atomic_write_bytes(
        folder / "report.html", to_html(blocks, title).encode("utf-8"), REPORT_FILE_MODE
    )
    return written


# ---------------------------------------------------------------- the parent run's answer

# leave the protocol's description at least a first paragraph below
BUDGET = LIMIT - len(SEPARATOR) - 1000
FOOTER = (
    "Every comparison's numbers are metrics of this run, `cmp.<a>_vs_<b>.<split>.<stat>`: `mean_diff`, "
    "`t_low` and `t_high` (t-interval over seeds), `boot_low` and `boot_high` (hierarchical bootstrap), `wins` of "
    "`n` seeds; {unit}. The whole report is in this run's artifacts (`report/report.html`)."
)


@dataclass(frozen=True)
class ArmRows:
    """The arms' summary runs ``log_arm_rows`` writes: arm -> ``arm_metrics`` of every split."""

    rows: dict[str, dict[str, float]]
    reference: str
    notes: dict[str, str]  # each row's description
    split: str  # the split the runs list sorts by and shows


@dataclass(frozen=True)
class Summary:
    """The metrics and the Markdown block ``log_summary`` puts on the parent run, and the arms' rows."""

    metrics: dict[str, float]
    text: str
    arms: ArmRows | None = None

    @property
    def comparisons(self) -> int:
        return len({k.rsplit(".", 1)[0] for k in self.metrics})


def results_text(blocks: list[Block], title: str, unit: str) -> str:
    """The Results section of ``blocks`` as Markdown for the run's description, within ``BUDGET`` characters.

    ``title`` follows "Results of the report" in its heading (which marks the block for the next build).

    Stated results become list items, sub-headings bold lines, paragraphs stay paragraphs
    (a paragraph the same as one above, the caveats of a second split, is said once); tables
    and figures are left to the report. Results that do not fit are counted, not cut mid-sentence.
    """
    parts, inside = [], False
    for block in blocks:
        if isinstance(block, Heading) and block.level == 2:
            inside = block.text == "Results"
            continue
        if not inside:
            continue
        if isinstance(block, Heading):
            parts.append(f"**{block.text}**")
        elif isinstance(block, Quote):
            parts.append(f"- {block.text}")
        elif (
            isinstance(block, Para) and block.text not in parts
        ):  # the caveats of a second split: said above
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts += [f"- {item}" for item in block.items]
    head, foot = f"{HEAD}{title}", FOOTER.format(unit=unit)
    kept, used = [], len(head) + len(foot) + 4
    for i, part in enumerate(parts):
        if used + len(part) + 2 > BUDGET - 150:  # 150: room for the line saying what was left out
            left = sum(p.startswith("- ") for p in parts[i:])
            kept.append(
                f"- … {left} more result{'s' if left != 1 else ''} and the caveats are in the report (left out "
                "to fit MLflow's description)."
                if left
                else "- … the rest is in the report (left out to fit MLflow's description)."
            )
            break
        kept.append(part)
        used += len(part) + 2
    return "\n\n".join([head, *kept, foot])


def ablation_metrics(items: dict[str, list]) -> dict[str, float]:
    """``cmp.*`` of every comparison of an ablation report (``results.contents`` per split), in points."""
    out: dict[str, float] = {}
    for split, pairs in items.items():
        for c, _ in pairs:
            if (
                c.paired is None
            ):  # no seed has both arms: the report says so; nothing to show but n = 0
                out |= comparison_metrics(
                    c.a,
                    c.b,
                    split,
                    mean_diff=math.nan,
                    t_low=math.nan,
                    t_high=math.nan,
                    boot_low=math.nan,
                    boot_high=math.nan,
                    wins=0,
                    n=0,
                )
            else:
                out |= paired_metrics(c.a, c.b, split, c.paired, c.bootstrap)
    return out


ROW_NOTE = (
    "**{arm}** in the report {title}, over its finished seeds. `<split>.n`: seeds; `<split>.acc`: mean "
    "accuracy (%), `.low` and `.high` its 95% Student-t interval over seeds; `<split>.diff`: {arm} minus "
    "{reference} paired by seed (points), `.low` and `.high` its 95% t-interval. Each number as the "
    "report's tables state it (2 decimals). The seeds' runs are the cells under the study's parent run "
    "(tag `summary_of`)."
)


def ablation_arm_rows(
    summaries: dict[str, list[tables.ArmSummary]],
    comparisons: dict[str, list[tables.Comparison]],
    reference: str,
    title: str,
) -> ArmRows | None:
    """Each arm's row over the splits: mean and interval (the Accuracy table), difference to ``reference`` (Results).

    None when no arm has a finished seed.
    """
    rows: dict[str, dict[str, float]] = {}
    for split, arms in summaries.items():
        diffs = {c.a: c.paired for c in comparisons.get(split, []) if c.b == reference and c.paired}
        for s in arms:
            if not s.values:
                continue
            mi = mean_interval(s.values, tables.CONFIDENCE)
            acc = (float(f"{100 * s.mean:.2f}"), _shown(mi.low), _shown(mi.high))
            p = diffs.get(s.arm) if s.arm != reference else None
            diff = (_shown(p.mean_difference), _shown(p.ci_low), _shown(p.ci_high)) if p else None
            rows.setdefault(s.arm, {}).update(arm_metrics(split, n=s.n, acc=acc, diff=diff))
    if not rows:
        return None
    notes = {arm: ROW_NOTE.format(arm=arm, reference=reference, title=title) for arm in rows}
    return ArmRows(rows, reference, notes, next(iter(summaries)))


def _shown(fraction: float) -> float:
    """A fraction in points with the report's 2 decimals (half away from zero, as ``fmt``); nan stays nan."""
    return float(fmt(100 * fraction, 2)) if math.isfinite(fraction) else math.nan


def paired_metrics(
    a: str, b: str, split: str, paired, boot, scale: float = 100.0
) -> dict[str, float]:
    """``cmp.*`` of one comparison given as a ``PairedComparison`` and its bootstrap ``CI`` (or None)."""
    return comparison_metrics(
        a,
        b,
        split,
        mean_diff=scale * paired.mean_difference,
        t_low=scale * paired.ci_low,
        t_high=scale * paired.ci_high,
        boot_low=scale * boot.low if boot else math.nan,
        boot_high=scale * boot.high if boot else math.nan,
        wins=paired.wins,
        n=paired.n,
    )
