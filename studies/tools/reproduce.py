"""Entry point: re-train chosen cells of a published study and judge them against its evidence.

``workbench reproduce --protocol studies/protocols/X.yaml --cells base/seed0,vit/seed1`` trains
the chosen cells through the ablation's own path (``run_cells`` with the study's one parent, as
``ablate`` runs them) into a SQLite store of its own (``--store-dir``, default
``<output-dir>/<study>/``: the user's store is never touched and a second invocation re-uses the
cells already trained there), then compares them with the published evidence
(``docs/results/<study>/evidence``) at three levels (``reports.reproduction``): bitwise,
numerical, conclusion. Exit status 0 when the level reached is at least ``--level``, 1 when not.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import click

from reports.collect import ReportError, load_study
from reports.evidence import FORMAT, export_format, load_evidence
from reports.reproduction.judge import (
    LEVELS,
    at_least,
    check_cell,
    check_conclusions,
    level_reached,
    spreads,
)
from studies.ablation.ablate import AblationStudy, open_protocol
from studies.runtime.options import StudyOptions, check_protocol_amp, study_options
from studies.runtime.outcome import Status
from studies.runtime.study_kind import run_cells
from tracking.export.run_export import metric_histories
from tracking.store.offline_store import use_folder_store
from studies.runtime.kernel_match import CAPS_APPLIED, restart_with
from workbench.kernel_caps import CAP_VARIABLES, KernelCapsError, caps_for, notes
from workbench.kernel_identity import kernel_identity, recorded_identity

CELL = re.compile(r"^(?P<arm>[^/\s]+)/seed(?P<seed>\d+)$")
CAP_VARIABLES_AND_MARK = (*CAP_VARIABLES, CAPS_APPLIED)
# This code's repository: its docs/results hold the studies it publishes.
REPOSITORY = Path(__file__).resolve().parents[2]


def published_evidence(protocol_path: str | Path, name: str) -> Path:
    """``docs/results/<name>/evidence`` of the repository that holds the protocol file (looked for
    from its folder up), else of this code's repository: the same folder from any working folder
    (before, the default was relative to the current one)."""
    relative = Path("docs", "results", name, "evidence")
    for folder in Path(protocol_path).resolve().parents:
        if (folder / relative).is_dir():
            return folder / relative
    return REPOSITORY / relative


class ChosenCells(AblationStudy):
    """The ablation kind, restricted to the chosen cells (the protocol and its hash unchanged)."""

    def __init__(self, options: StudyOptions, chosen: list[tuple[str, int]]) -> None:
        super().__init__(options)
        self.chosen = chosen

    def cells(self, protocol):
        return [c for c in protocol.cells() if (c.arm, c.seed) in self.chosen]

    def begin(self, parent) -> None:
        # The re-training's store holds the chosen cells only: its parent ends FINISHED when
        # they are, not FAILED for the cells nobody asked for.
        parent.expected_cells = len(self.chosen)


def parse_cells(text: str, protocol) -> list[tuple[str, int]]:
    """``base/seed0,vit/seed1`` -> [("base", 0), ("vit", 1)], each a cell of the protocol."""
    known = {(c.arm, c.seed) for c in protocol.cells()}
    out = []
    for part in (p.strip() for p in text.split(",")):
        match = CELL.match(part)
        if not match:
            raise click.BadParameter(
                f"{part!r}: expected ARM/seedN, e.g. base/seed0", param_hint="--cells"
            )
        cell = (match["arm"], int(match["seed"]))
        if cell not in known:
            raise click.BadParameter(
                f"{part}: not a cell of {protocol.name} (arms "
                f"{', '.join(a.name for a in protocol.arms)}; seeds "
                f"{', '.join(map(str, protocol.seeds))})",
                param_hint="--cells",
            )
        if cell not in out:
            out.append(cell)
    return out


@click.command("reproduce")
@click.option(
    "--protocol",
    "protocol_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The published study's protocol file (its hash must be the evidence's).",
)
@click.option(
    "--cells",
    "cells_text",
    required=True,
    help="Cells to re-train, comma-separated ARM/seedN (e.g. base/seed0,vit/seed1).",
)
@click.option(
    "--evidence",
    "evidence_dir",
    default=None,
    type=click.Path(file_okay=False),
    help="The published evidence folder (default docs/results/<study>/evidence of the repository "
    "that holds the protocol file, whatever the current folder).",
)
@click.option(
    "--level",
    type=click.Choice(LEVELS),
    default="bitwise",
    show_default=True,
    help="The level asked for: exit status 1 when the re-training falls short of it.",
)
@click.option(
    "--store-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Where the re-training's own SQLite store goes (default <output-dir>/<study>).",
)
@click.option(
    "--json",
    "json_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also write the comparison, cell by cell and verdict by verdict, here.",
)
@click.option(
    "--match-kernels",
    is_flag=True,
    help="Cap ATen's, oneDNN's and MKL's instruction sets to the ones the published cells "
    "recorded (kernel.* params), in a fresh process started with ATEN_CPU_CAPABILITY, "
    "ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS; refused in one line where this CPU lacks them.",
)
@study_options("outputs/reproduce", "Checkpoints and predictions of the re-trained cells.")
def reproduce(
    protocol_path: str,
    cells_text: str,
    evidence_dir: str | None,
    level: str,
    store_dir: str | None,
    json_path: str | None,
    match_kernels: bool,
    options: StudyOptions,
) -> None:
    """Re-train chosen cells of a published study and judge them against its evidence: bitwise, numerical, conclusion."""
    # The study's name first (no store opened): the re-training's own store is chosen by it, and
    # the protocol is opened (committed, not frozen under another hash) against that store.
    loaded = AblationStudy.load(protocol_path)
    evidence_path = (
        Path(evidence_dir) if evidence_dir else published_evidence(protocol_path, loaded.name)
    )
    if export_format(evidence_path) != FORMAT:
        raise ReportError(
            f"{evidence_path}: format {export_format(evidence_path)!r}; reproduce re-trains "
            f"ablation studies ({FORMAT})"
        )
    evidence = load_evidence(evidence_path)
    spec = evidence.study.spec
    if spec.hash != loaded.hash:
        raise ReportError(
            f"{protocol_path}: hash {loaded.hash[:12]} is not the evidence's {spec.hash[:12]} "
            f"({evidence_path}): not the published study"
        )
    chosen = parse_cells(cells_text, loaded)
    unpublished = [f"{a}/seed{s}" for a, s in chosen if (a, s) not in evidence.study.cells]
    if unpublished:
        raise ReportError(f"--cells: {', '.join(unpublished)} not reported in {evidence_path}")
    entries = {e["run_id"]: e for e in _runs(evidence_path)["cells"]}
    if match_kernels:
        recorded = [
            recorded_identity(entries[evidence.study.cells[c].record.run_id]["params"])
            for c in chosen
        ]
        apply_recorded_caps(recorded)
    check_protocol_amp(loaded, options.device)
    store = Path(store_dir) if store_dir else options.output_dir / loaded.name
    uri = use_folder_store(store, loaded.name)
    protocol = open_protocol(protocol_path, options.allow_dirty)
    click.echo(f"re-training {len(chosen)} cells of {protocol.name} into {uri}")
    outcomes = run_cells(ChosenCells(options, chosen), protocol, Path(protocol_path), options)
    failed = [o.message for o in outcomes if o.status == Status.FAILED]
    if failed:
        raise ReportError("re-training failed: " + "; ".join(failed))
    retrained = load_study(spec, {})
    missing = [f"{a}/seed{s}" for a, s in chosen if (a, s) not in retrained.cells]
    if missing:
        raise ReportError(f"no finished re-trained run of {', '.join(missing)} in {uri}")
    checks = []
    for arm, seed in chosen:
        published, mine = evidence.study.cells[(arm, seed)], retrained.cells[(arm, seed)]
        checks.append(
            check_cell(
                published,
                entries[published.record.run_id],
                mine,
                metric_histories(mine.record.run_id),
                spreads(evidence.study, arm),
            )
        )
        for line in checks[-1].lines():
            click.echo(line)
    conclusions = check_conclusions(evidence, {(a, s): retrained.cells[(a, s)] for a, s in chosen})
    click.echo("conclusion: the study's comparisons with the re-trained cells in place")
    for verdict in conclusions:
        click.echo("  " + verdict.line())
    reached = level_reached(checks, conclusions)
    ok = at_least(reached, level)
    click.echo(
        f"level reached: {reached} (asked: {level}): "
        + ("reproduced" if ok else "NOT reproduced at the level asked")
    )
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "protocol": {"name": spec.name, "hash": spec.hash},
                    "cells": [vars(c) for c in checks],
                    "conclusions": [vars(v) | {"stands": v.stands} for v in conclusions],
                    "level_reached": reached,
                    "level_asked": level,
                },
                indent=1,
                default=str,
            )
        )
    if not ok:
        click.get_current_context().exit(1)


def apply_recorded_caps(recorded: list[dict[str, str]]) -> None:
    """Run the rest of this command under the kernel caps the chosen cells recorded.

    The caps act only when set before torch starts, so the first time this process starts itself
    again with them (same arguments); the restarted process finds them set and goes on.
    """
    here = kernel_identity("cpu")
    try:
        wanted = [caps_for(r, here) for r in recorded]
    except KernelCapsError as err:
        raise click.UsageError(f"--match-kernels: {err}") from err
    caps = wanted[0]
    if any(w != caps for w in wanted):
        raise click.UsageError(
            "--match-kernels: the chosen cells ran on different kernels; reproduce them separately"
        )
    described = " ".join(f"{k}={v}" for k, v in caps.items())
    if all(os.environ.get(k) == v for k, v in caps.items()):
        aten = (recorded[0].get("kernel.aten_capability"), here.get("kernel.aten_capability"))
        if aten[0] != aten[1]:
            raise click.UsageError(
                f"--match-kernels: ATen runs {aten[1]} under {described}, not {aten[0]}"
            )
        click.echo(f"kernels capped to the record: {described}")
        for note in notes(recorded[0], here):
            click.echo(f"note: {note}")
        return
    try:  # set once already, and still not in force: refused, no loop
        restart_with(caps, lambda line: click.echo(f"--match-kernels: {line}", err=True))
    except RuntimeError as err:
        raise click.UsageError(f"--match-kernels: {err}") from None


def _runs(folder: Path) -> dict:
    return json.loads((folder / "runs.json").read_text(encoding="utf-8"))
