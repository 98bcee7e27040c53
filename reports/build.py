"""Build a protocol's report: query MLflow, compute, render, write, log.

``build_report`` is the whole job behind ``workbench report``. The output folder
``<out_root>/<protocol name>/`` holds ``report.md``, ``report.html`` (self-contained) and
``figures/*.png``; the same files are logged under ``report/`` on the protocol's newest
parent run of the reported hash. Nothing in them depends on when or where the report was
built, only on the runs, so rebuilding from the same runs gives byte-identical files.
Report files are 0666 masked by the umask (0644 under umask 022), so the group can read
them. ``ReportResult.problems`` lists missing cells and stale runs: ``report --strict``
exits 1 on any. Which kind's builder reports a protocol is the table of kinds'
(``workbench.kinds``, its ``report`` column; the interface: ``reports.output.ReportRequest``);
this module holds the ablation kind's builder, whose sections live in ``document``,
``results``, ``configuration`` and ``provenance``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from reports import configuration, document, results, tables
from reports.calibration.calibration_blocks import ablation_calibration
from reports.collect import (
    ReportError,
    StudyData,
    check_rebuild_folder,
    load_study,
    protocol_file,
    resolve_protocol,
)
from reports.data_size.size_blocks import data_size_section
from reports.data_size.size_reading import size_reading
from reports.evidence import (
    EVIDENCE_DIR,
    FORMAT as EVIDENCE_FORMAT,
    export_evidence,
    export_format,
    load_evidence,
)
from reports.output import (
    ReportRequest,
    ReportResult,
    Summary,
    ablation_arm_rows,
    ablation_metrics,
    log_report,
    results_text,
    write_report,
)
from reports.provenance import BuildInputs, stale_items
from tracking.record import queries
from workbench.kinds import BY_NAME, DEFAULT_KIND, LOOKUP_ORDER, PROTOCOL_KINDS
from workbench.protocol import kind_of, read_yaml

DEFAULT_OUT_ROOT = Path("reports")


def parse_compare(values: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``["cnn:vit_small"]`` -> ``[("cnn", "vit_small")]``."""
    pairs = []
    for value in values:
        a, sep, b = value.partition(":")
        if not sep or not a or not b:
            raise ReportError(f"--compare {value!r}: expected ARM_A:ARM_B")
        if a == b:
            raise ReportError(f"--compare {value!r}: an arm against itself")
        pairs.append((a, b))
    return pairs


def parse_interactions(values: tuple[str, ...] | list[str]) -> list[tuple[str, str, str, str]]:
    """``["vit_r:vit:cnn_r:cnn"]`` -> ``[("vit_r", "vit", "cnn_r", "cnn")]``: (A - B) - (C - D)."""
    quads = []
    for value in values:
        parts = value.split(":")
        if len(parts) != 4 or not all(parts):
            raise ReportError(
                f"--interaction {value!r}: expected A:B:C:D, four arm names for (A - B) - (C - D)"
            )
        quads.append(tuple(parts))
    return quads


def build_report(
    protocol: str,
    out_root: Path = DEFAULT_OUT_ROOT,
    hash_prefix: str | None = None,
    commit: str | None = None,
    compare: list[tuple[str, str]] | None = None,
    n_resamples: int = tables.BOOTSTRAP_RESAMPLES,
    log: bool = True,
    strict: bool = False,
    evidence: bool = False,
    interactions: list[tuple[str, str, str, str]] | None = None,
) -> ReportResult:
    """Build, write and (optionally) log the report of one protocol hash.

    Args:
        protocol: Protocol YAML path or protocol name.
        out_root: The report goes to ``out_root/<protocol name>/``.
        hash_prefix: Report this recorded hash instead of the protocol file's.
        commit: Use only runs of this code commit (prefix); default: newest finished run per cell.
        compare: Extra (a, b) arm pairs, beyond every arm against the reference.
        interactions: (a, b, c, d) arm quadruples: the report adds (a - b) - (c - d) per seed
            with its t-interval and hierarchical bootstrap. Ablation protocols only.
        n_resamples: Bootstrap resamples.
        log: Log the report files to the newest parent run of the hash (and to the
            ``mlflow run`` launcher run when there is one).
        strict: Only recorded in the report's build inputs; the caller fails on ``result.problems``.
        evidence: Also export the study's evidence (run records and per-example predictions)
            to ``out_root/<protocol name>/evidence/``, from which ``build_from_evidence``
            rebuilds the same report without the store. Every protocol kind.

    Raises:
        ReportError: Nothing to report, a bad option, or runs lacking what the report needs.
        tracking.record.queries.QueryError: The protocol was never run against this tracking store.
        workbench.protocol.ProtocolError: The protocol file is invalid.
    """
    request = ReportRequest(
        protocol,
        Path(out_root),
        hash_prefix,
        commit,
        tuple(compare or ()),
        n_resamples,
        log,
        strict,
        evidence,
        tuple(interactions or ()),
    )
    path = protocol_file(protocol)
    if path is not None:
        return BY_NAME[kind_of(read_yaml(path))].load("report").build(path, request)
    for kind in LOOKUP_ORDER:  # a protocol known only by name: the first kind whose study it is
        result = kind.load("report").by_name(protocol, request)
        if result is not None:
            return result
    raise ReportError(f"{protocol}: no protocol file and no study of that name in the store")


class AblationReport:
    """The ablation kind's report builder (the interface: ``reports.output.ReportRequest``)."""

    evidence_format = EVIDENCE_FORMAT

    def build(self, path: Path, request: ReportRequest) -> ReportResult:
        return self.by_name(request.protocol, request)

    def by_name(self, name: str, request: ReportRequest) -> ReportResult:
        spec, counts = resolve_protocol(name, request.hash_prefix)
        study = load_study(spec, counts, request.commit)
        log_targets = [study.parent_run_id] if request.log and study.parent_run_id else []
        inputs = BuildInputs(
            spec.source,
            spec.hash,
            request.hash_prefix,
            request.commit,
            list(request.compare),
            request.n_resamples,
            tables.BOOTSTRAP_SEED,
            tables.CONFIDENCE,
            request.strict,
            list(request.interactions),
        )
        with tempfile.TemporaryDirectory() as tmp:
            analysis = queries.analysis_figures(spec.name, spec.hash, Path(tmp))
        result = render_study(study, inputs, request.out_root, log_targets, analysis)
        if request.log and not study.parent_run_id:
            result.messages.append(
                f"no parent run of {spec.name}@{spec.short_hash} found: the report is not logged to MLflow"
            )
        log_report(result, result.folder, log_targets if request.log else None)
        if request.evidence:
            folder = export_evidence(
                result.folder / EVIDENCE_DIR, study, inputs, log_targets, analysis
            )
            result.messages.append(
                f"wrote the evidence of {len(study.cells)} cells to {folder} "
                f"(rebuild: workbench report --from-evidence {folder} --out-dir DIR)"
            )
        return result

    def rebuild(self, evidence_dir: Path, out_root: Path) -> ReportResult:
        loaded = load_evidence(evidence_dir)
        check_rebuild_folder(evidence_dir, out_root, loaded.study.spec.name)
        return render_study(
            loaded.study, loaded.inputs, Path(out_root), loaded.logged_to, loaded.analysis
        )


ABLATION_REPORT = AblationReport()


def build_from_evidence(evidence_dir: Path, out_root: Path) -> ReportResult:
    """Rebuild a published report from its evidence export alone: no MLflow store is opened.

    The study (every cell run of the hash, the choice of one per cell, predictions, curves),
    the build options and the analysis figures come from the export; the report goes through
    the same rendering as ``build_report`` and differs from the published one by one header
    line saying it was rebuilt from the export.

    Raises:
        ReportError: The export is incomplete or damaged (the message names the file), or the
            output folder is the one holding the export (the published report is never overwritten).
    """
    evidence_dir = Path(evidence_dir)
    found = export_format(evidence_dir)
    builders = {k.load("report").evidence_format: k.load("report") for k in PROTOCOL_KINDS}
    # an unknown format goes to the default kind's reader, which names what it expected
    builder = builders.get(found) or BY_NAME[DEFAULT_KIND].load("report")
    result = builder.rebuild(evidence_dir, Path(out_root))
    result.messages.insert(
        1, f"rebuilt from {evidence_dir} without the MLflow store (nothing is logged)"
    )
    return result


def render_study(
    study: StudyData,
    inputs: BuildInputs,
    out_root: Path,
    log_targets: list[str],
    analysis: list[queries.AnalysisFigure],
) -> ReportResult:
    """Compute every table and figure of an ablation study and write the report files."""
    spec = study.spec
    config, conflicts = configuration.protocol_config(spec.canonical)
    messages = [
        (
            f"{spec.name}@{spec.short_hash}: {len(study.cells)} of {len(spec.arms) * len(spec.seeds)} cells "
            f"have a finished run ({spec.source})"
        )
    ]
    messages += [f"warning: {w}" for w in document.warning_items(study, conflicts)]
    messages += [f"missing: {a}/seed{s} ({why})" for a, s, why in study.missing]
    if not study.cells:
        raise ReportError(
            "\n".join(
                messages
                + [f"no finished cell runs of {spec.name}@{spec.short_hash}: nothing to report"]
            )
        )
    try:
        pairs = tables.comparison_pairs(study, inputs.compare)
        quads = tables.check_interactions(study, inputs.interactions)
    except ValueError as err:
        raise ReportError(str(err)) from err
    summaries = {
        split: [tables.arm_summary(study, arm, split) for arm in spec.arms] for split in spec.splits
    }
    comparisons = {
        split: [tables.compare(study, a, b, split, inputs.n_resamples) for a, b in pairs]
        for split in spec.splits
    }
    decimals = {split: results.display_decimals(rows) for split, rows in summaries.items()}
    items = {
        split: results.contents(
            comparisons[split], summaries[split], len(spec.seeds), decimals[split]
        )
        for split in spec.splits
    }
    interactions = {
        split: results.interaction_contents(
            [tables.interaction(study, quad, split, inputs.n_resamples) for quad in quads],
            decimals[split],
        )
        for split in spec.splits
    }
    data_size = {split: size_reading(study, split, inputs.n_resamples) for split in spec.splits}
    blocks = (
        document.header(study, inputs, log_targets, conflicts)
        + results.results_section(study, items, interactions, inputs.n_resamples)
        + data_size_section(data_size, decimals, spec.seeds)
        + configuration.configuration_blocks(config, conflicts)
        + document.accuracy_section(study, summaries, decimals)
        + results.comparison_section(study, items, inputs.n_resamples)
        + document.per_class_section(study)
        + ablation_calibration(study, pairs)
        + configuration.cost_blocks(study, config)
        + document.curves_section(study)
        + document.analysis_section(analysis)
        + document.runs_section(study)
    )
    folder = Path(out_root) / spec.name
    figure_paths = write_report(folder, blocks, f"{spec.name}@{spec.short_hash} report")
    expected = len(spec.arms) * len(spec.seeds)
    summary = Summary(
        ablation_metrics(items),
        results_text(
            blocks,
            f": {spec.name}@{spec.short_hash}, {len(study.cells)} of {expected} cells",
            "accuracy differences in percentage points",
        ),
        ablation_arm_rows(summaries, comparisons, spec.reference, f"{spec.name}@{spec.short_hash}"),
    )
    return ReportResult(
        folder,
        folder / "report.md",
        folder / "report.html",
        figure_paths,
        study,
        summaries,
        comparisons,
        interactions={split: [ix for ix, _ in rows] for split, rows in interactions.items()},
        data_size={split: r for split, r in data_size.items() if r is not None},
        messages=messages,
        problems=stale_items(study.attempts, [f"{a}/seed{s}" for a, s, _ in study.missing]),
        summary=summary,
    )
