"""The steps every report of a kind that acts on trained models shares (intervention, attribution).

Each kind's report (``reports/<kind>/<kind>_report.py``) computes its own results and sections;
what is the same for all of them lives here: the cells' warnings, the header, the closing
provenance and acted-on tables, and ``ActedReport``, which resolves the hash, renders, logs,
exports and rebuilds from an export for any such kind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from reports import provenance
from reports.collect import (
    ReportError,
    check_rebuild_folder,
    newer_attempts,
    recorded_file,
    resolve_hash,
    shown_path,
)
from reports.output import (
    ReportRequest,
    ReportResult,
    Summary,
    log_report,
    refuse_interactions,
    results_text,
    write_report,
)
from reports.render import Block, Bullets, Heading, Para, Table
from tracking.record import queries
from workbench.protocol import SHORT_HASH_LEN, load_any
from workbench.kinds import BY_NAME

FLAG = "⚠"
SPLIT_WORDS = {"val": "validation", "test": "test"}
# The build of a kind's blocks: (study, inputs, log targets, resamples) -> (blocks, warnings,
# what --strict refuses, reported cells, metrics).
BuildBlocks = Callable[..., tuple[list[Block], list[str], list[str], int, dict[str, float]]]


def cell_warnings(study) -> tuple[list[str], list, list[str]]:
    """(the expected cells with no finished run, newer unfinished attempts, the warnings that say both)."""
    protocol, chosen = study.protocol, study.chosen
    arms, seeds = list(protocol.arms), list(protocol.seeds)
    missing = [f"{a}/seed{s}" for s in seeds for a in arms if (a, s) not in chosen]
    attempts = newer_attempts(study.records, chosen, tuple(arms), tuple(seeds))
    warnings = (
        [f"{len(missing)} expected cell(s) have no finished run: {', '.join(missing)}"]
        if missing
        else []
    )
    warnings += [
        f"{r.arm}/seed{r.seed} has a newer {r.status} run {r.run_id}; the report uses the older finished run"
        for r in attempts
    ]
    return missing, attempts, warnings


def header_blocks(
    study,
    inputs: provenance.BuildInputs,
    log_targets: list[str],
    *,
    what: str,
    settings: str,
    warnings: list[str],
) -> list[Block]:
    """Title, description, what the study acts on (then ``settings``), provenance, cells, warnings."""
    protocol, digest, chosen = study.protocol, study.digest, study.chosen
    arms, seeds = list(protocol.arms), list(protocol.seeds)
    n, expected = len(chosen), len(arms) * len(seeds)
    acted = (
        f"the finished ViT cells of `{protocol.acts_on.protocol}` (hash `{protocol.acts_on.hash[:SHORT_HASH_LEN]}`)"
        if protocol.acts_on
        else f"timm `{protocol.pretrained.model}` (weights `{protocol.pretrained.weights}`)"
    )
    header: list[Block] = [
        Heading(1, f"Report: {protocol.name}@{digest[:SHORT_HASH_LEN]}"),
        Para(protocol.description),
        Bullets(
            [
                f"{what} protocol `{protocol.name}`, hash `{digest}` (from {inputs.protocol_source}).",
                f"Acts on {acted}: arms {', '.join(arms)}; seeds {', '.join(map(str, seeds))} (paired by seed and by "
                f"image); {settings}",
                *provenance.header_bullets(
                    inputs,
                    protocol.name,
                    "one run per cell: its newest finished run",
                    log_targets,
                    study.tracking_uri,
                    study.rebuilt_from,
                ),
                f"Cells with a finished run: **{n} of {expected}**"
                + ("." if n == expected else f" {FLAG}"),
            ]
        ),
    ]
    if warnings:
        header += [Heading(2, "Warnings"), Bullets([f"{FLAG} {w}" for w in warnings])]
    return header


def closing_blocks(study, attempts: list, acted_on: Callable[[list], list[Block]]) -> list[Block]:
    """The provenance of every reported cell, then the kind's acted-on table (``acted_on(rows)``)."""
    protocol, chosen = study.protocol, study.chosen
    arms, seeds = list(protocol.arms), list(protocol.seeds)
    rows = [(a, s, chosen[(a, s)]) for s in seeds for a in arms if (a, s) in chosen]
    return provenance.provenance_blocks(
        rows, attempts, chosen, "arm", study.tracking_uri
    ) + acted_on(rows)


def acted_on_table(
    rows: list[tuple[str, int, queries.CellRecord]],
    columns: list[str],
    values: Callable[[dict], list[str]],
    note: str,
) -> list[Block]:
    """Which weights each cell acted on and its reload proof, then the kind's ``columns`` (``values``
    of the cell's metrics), and the threads; ``note`` says what the columns mean."""
    body = []
    for arm, seed, r in rows:
        m = r.metrics
        proof = (
            "n/a (pretrained)"
            if "reload_proof_passed" not in m
            else f"{'reproduced' if m['reload_proof_passed'] == 1.0 else 'NOT reproduced'}, max |prob difference| "
            f"{m.get('reload_proof_max_abs_diff', math.nan):.3g}"
        )
        source = (
            f"`{r.tags['source_run_id']}`"
            if r.tags.get("source_run_id")
            else f"`{r.tags.get('source_identity', 'n/a')}`"
        )
        body.append([arm, str(seed), source, proof, *values(m), r.tags.get("threads", "n/a")])
    return [
        Heading(3, "Acted-on models"),
        Table(
            ["arm", "seed", "trained run (or weights)", "reload proof", *columns, "threads"],
            body,
            ["l", "r", "l", "l", *["r"] * len(columns), "r"],
            [note],
            css_class="wide nowrap",
        ),
    ]


@dataclass
class ActedBlocks:
    """What a kind's ``build_blocks`` gathers as it goes over the reported arms: the results (under
    their heading), the per-arm sections, the warnings (the cells' own first) and the metrics;
    ``finish`` puts the header and the closing tables around them, the same for every kind."""

    study: Any
    results: list[Block] = field(default_factory=lambda: [Heading(2, "Results")])
    sections: list[Block] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.missing, self.attempts, self.warnings = cell_warnings(self.study)

    def reported_arms(self) -> Iterator[tuple[str, dict[int, Any]]]:
        """Each acted-on arm with a reported cell, and its reported cells by seed (file order)."""
        protocol, chosen = self.study.protocol, self.study.chosen
        for arm in protocol.arms:
            cells = {s: self.study.cells[(arm, s)] for s in protocol.seeds if (arm, s) in chosen}
            if cells:
                yield arm, cells

    def finish(
        self,
        inputs: provenance.BuildInputs,
        log_targets: list[str],
        acted_on: Callable[[list], list[Block]],
        *,
        what: str,
        settings: str,
        after_header: list[Block] = (),
    ) -> tuple[list[Block], list[str], list[str], int, dict[str, float]]:
        """What ``BuildBlocks`` returns: the header (``header_blocks``, then ``after_header``),
        the results, the sections, the closing tables (``closing_blocks``), and beside them the
        warnings, what ``--strict`` refuses, the number of reported cells and the metrics."""
        header = header_blocks(
            self.study, inputs, log_targets, what=what, settings=settings, warnings=self.warnings
        )
        closing = closing_blocks(self.study, self.attempts, acted_on)
        blocks = header + list(after_header) + self.results + self.sections + closing
        stale = provenance.stale_items(self.attempts, self.missing)
        return blocks, self.warnings, stale, len(self.study.chosen), self.metrics


class ActedReport:
    """The report of a kind that acts on trained models, from the kind's report module.

    The module (``reports/<kind>/<kind>_report.py``) names: ``READOUT`` (its ``Readout`` class:
    the ``kind``, a name of the table of kinds ``workbench.kinds``, and ``from_store``,
    ``(protocol, digest)`` -> its readout from the store), ``EVIDENCE`` (its evidence module:
    ``export_evidence``, ``(folder, readout, inputs, log_targets)`` -> the folder written,
    ``load_evidence``, folder -> an export read back: ``study``, ``inputs``, ``logged_to``, and
    ``FORMAT``, the ``format`` its exports declare), ``DIFFERENCES`` (what its summary's numbers
    are, in words) and ``build_blocks`` (``BuildBlocks``).
    """

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.readout = module.READOUT
        self.evidence = module.EVIDENCE
        self.kind: str = self.readout.kind
        self.evidence_format: str = self.evidence.FORMAT

    def build(self, path: Path, request: ReportRequest) -> ReportResult:
        """Build, write and (optionally) log the report of the protocol file ``path``, and with
        ``request.evidence`` export what it was computed from to ``<out_root>/<name>/evidence/``.
        ``request.compare``: arm pairs, for the kinds whose module sets ``COMPARES_ARMS``
        (refused in one line for the others)."""
        refuse_interactions(request, BY_NAME[self.kind].article)
        protocol = load_any(path)
        out_root, hash_prefix, n_resamples = (
            request.out_root,
            request.hash_prefix,
            request.n_resamples,
        )
        log, strict, evidence, compare = (
            request.log,
            request.strict,
            request.evidence,
            list(request.compare),
        )
        self.check_compare(protocol, compare or [])
        counts = queries.hash_counts(protocol.name)
        digest = resolve_hash(protocol.name, counts, hash_prefix, protocol.hash)
        if digest != protocol.hash:
            raise ReportError(
                f"--hash {hash_prefix}: {protocol.name}@{digest[:SHORT_HASH_LEN]} is not the hash of "
                f"{shown_path(Path(protocol.source_file))}; report {BY_NAME[self.kind].article} "
                "protocol with its own file"
            )
        parents = queries.parent_runs(protocol.name, digest)
        log_targets = [parents[0].run_id] if log and parents else []
        inputs = provenance.BuildInputs(
            f"file {shown_path(Path(protocol.source_file))}",
            digest,
            hash_prefix,
            None,
            list(compare or []),
            n_resamples,
            protocol.evaluation.seed,
            protocol.evaluation.confidence,
            strict,
        )
        study = self.readout.from_store(protocol, digest)
        result = self.render(study, inputs, Path(out_root), log_targets)
        if log and not parents:
            result.messages.append(
                f"no parent run of {protocol.name}@{digest[:SHORT_HASH_LEN]} found: the report is not logged"
            )
        log_report(result, result.folder, log_targets if log else None)
        if evidence:
            folder = self.evidence.export_evidence(
                result.folder / "evidence", study, inputs, log_targets
            )
            result.messages.append(
                f"wrote the evidence of {len(study.chosen)} cells to {folder} "
                f"(rebuild: workbench report --from-evidence {folder} --out-dir DIR)"
            )
        return result

    def by_name(self, name: str, request: ReportRequest) -> ReportResult | None:
        """The report of a protocol given by name: None when the store holds no study of this kind
        by that name; built from the protocol file its parent recorded when it was kept outside
        studies/protocols/; refused in one line otherwise (the file is needed)."""
        if not queries.holds_study(name, self.kind):
            return None
        recorded = recorded_file(name)
        if recorded is None:
            raise ReportError(
                f"{name} is {BY_NAME[self.kind].article} protocol: report it with its protocol "
                "file (studies/protocols/<name>.yaml or a path)"
            )
        return self.build(recorded, request)

    def check_compare(self, protocol, compare: list[tuple[str, str]]) -> None:
        """Refuse ``--compare`` for a kind that compares no arms, or naming an arm the protocol lacks."""
        if not compare:
            return
        if not getattr(self.module, "COMPARES_ARMS", False):
            raise ReportError(
                f"--compare: not for {BY_NAME[self.kind].article} protocol ({protocol.name}); "
                "its report sets every intervention against the intact model of the same cell"
            )
        for a, b in compare:
            unknown = [arm for arm in (a, b) if arm not in protocol.arms]
            if unknown:
                raise ReportError(
                    f"--compare {a}:{b}: {', '.join(unknown)} is not an arm {protocol.name} acts on "
                    f"(arms: {', '.join(protocol.arms)})"
                )

    def render(
        self, study, inputs: provenance.BuildInputs, out_root: Path, log_targets: list[str]
    ) -> ReportResult:
        """Compute every table and figure and write the report files."""
        protocol, short = study.protocol, study.digest[:SHORT_HASH_LEN]
        blocks, warnings, problems, n, metrics = self.module.build_blocks(
            study, inputs, log_targets, inputs.n_resamples
        )
        folder = Path(out_root) / protocol.name
        figure_paths = write_report(folder, blocks, f"{protocol.name}@{short} {self.kind} report")
        expected = len(protocol.arms) * len(protocol.seeds)
        messages = [
            f"{protocol.name}@{short}: {n} of {expected} cells have a finished run "
            f"({self.kind} protocol)"
        ] + [f"warning: {w}" for w in warnings]
        summary = Summary(
            metrics,
            results_text(
                blocks,
                f": {protocol.name}@{short}, {n} of {expected} cells",
                self.module.DIFFERENCES,
            ),
        )
        return ReportResult(
            folder,
            folder / "report.md",
            folder / "report.html",
            figure_paths,
            messages=messages,
            problems=problems,
            summary=summary,
        )

    def rebuild(self, evidence_dir: Path, out_root: Path) -> ReportResult:
        """The report rebuilt from an export of this kind alone (no store is opened)."""
        loaded = self.evidence.load_evidence(evidence_dir)
        check_rebuild_folder(evidence_dir, out_root, loaded.study.protocol.name)
        return self.render(loaded.study, loaded.inputs, Path(out_root), loaded.logged_to)
