"""Entry point: run a frozen protocol's arms x seeds as MLflow child runs.

Resuming is running the same command again: cells whose finished run exists (same
protocol hash, arm, seed, code commit and data fingerprint) are skipped, an interrupted
cell continues from its checkpoint in its own MLflow run, and the rest run.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import click
from tqdm.auto import tqdm

from studies.options import check_protocol_amp, threads_option
from studies.protocol import Cell, Protocol, ProtocolError, check_clean, check_frozen, load_protocol
from studies.train import TrainOutcome, prepare_data, train_one
from tracking.protocols import end_parent_run, recorded_hashes, start_parent_run
from tracking.runs import configure_tracking, git_state
from tracking.storage_guard import check_optuna_storage
from workbench.data import PreparedData

DEFAULT_PROTOCOL = "studies/protocols/smoke.yaml"


@dataclass
class CellOutcome:
    cell: Cell
    status: str  # finished | skipped | failed
    message: str
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)  # the cell run's latest metrics (wherever it was logged)


def open_protocol(path: str, allow_dirty: bool) -> Protocol:
    """Load, check committed-ness and frozen hash; errors name the file or key."""
    protocol = load_protocol(path)
    check_clean(path, allow_dirty)
    configure_tracking()
    check_frozen(protocol, recorded_hashes(protocol.name))
    return protocol


def cell_identity(cell: Cell) -> dict:
    """What makes a cell's run the same run: see DESIGN.md, 'Data flow of the main job'."""
    return {"protocol_hash": cell.protocol_hash, "arm": cell.arm, "seed": cell.seed,
            "code_commit": git_state()["git_commit"]}


def run_cell(
    protocol: Protocol, cell: Cell, data: PreparedData, parent_run_id: str, output_dir: Path,
    device: str = "auto", data_path: str | None = None, allow_dirty: bool = False,
) -> CellOutcome:
    """Train one cell as a child run; any exception becomes a failed outcome, not a crash."""
    tags = {"cell": "true", "protocol_name": protocol.name, "protocol_hash": protocol.hash, "arm": cell.arm,
            "seed": str(cell.seed), "is_reference": str(cell.is_reference).lower(),
            "allow_dirty": str(allow_dirty).lower()}
    try:
        outcome: TrainOutcome = train_one(
            cell.train_config(device=device, data_path=data_path), data, protocol.name,
            output_dir / protocol.name, run_name=f"{cell.arm}-seed{cell.seed}", parent_run_id=parent_run_id,
            identity=cell_identity(cell), tags=tags,
        )
    except Exception as err:  # one failing cell must not take the others down
        traceback.print_exc()
        return CellOutcome(cell, "failed", f"{cell.key}: {type(err).__name__}: {err}")
    return CellOutcome(cell, outcome.status, outcome.message, outcome.run_id, outcome.metrics)


def prepare_protocol_data(protocol: Protocol, data_path: str | None, download: bool) -> PreparedData:
    """Load the dataset once and make the split every cell shares (the pairing)."""
    spec = protocol.dataset if data_path is None else replace(protocol.dataset, path=data_path)
    return prepare_data(spec, download)


def run_protocol(
    protocol: Protocol, protocol_file: Path, output_dir: Path, device: str = "auto",
    data_path: str | None = None, allow_dirty: bool = False, download: bool = False,
) -> list[CellOutcome]:
    """Run every cell of ``protocol`` in this process, under one new parent run."""
    data = prepare_protocol_data(protocol, data_path, download)
    tqdm.write(f"{protocol.name}@{protocol.short_hash}: {len(protocol.cells())} cells on {data.display_name} "
               f"({len(data.train.labels)} train / {len(data.val.labels)} val), data {data.data_fingerprint[:12]}")
    parent = start_parent_run(protocol, protocol_file, allow_dirty)
    outcomes = []
    with tqdm(protocol.cells(), desc=f"{protocol.name} cells", unit="cell") as bar:
        for cell in bar:
            bar.set_postfix_str(cell.key)
            outcome = run_cell(protocol, cell, data, parent, output_dir, device, data_path, allow_dirty)
            tqdm.write(f"[{outcome.status}] {outcome.message}")
            outcomes.append(outcome)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed")}
    end_parent_run(parent, counts)
    return outcomes


@click.command("ablate")
@click.option("--protocol", "protocol_path", default=DEFAULT_PROTOCOL, show_default=True,
              type=click.Path(exists=True, dir_okay=False), help="Protocol YAML file.")
@click.option("--allow-dirty", is_flag=True, help="Run a protocol file with uncommitted changes (recorded on the runs).")
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None, help="Where this machine keeps the dataset, if not in the usual places.")
@click.option("--download/--no-download", default=False, show_default=True)
@click.option("--output-dir", type=click.Path(file_okay=False), default="outputs/ablate", show_default=True,
              help="Checkpoints and predictions of each cell.")
@click.option("--storage", default=None,
              help="Optuna storage URL: queue the cells there for `workbench worker` instead of running them here.")
@threads_option
def ablate(protocol_path, allow_dirty, device, data_path, download, output_dir, storage, threads):
    """Run (or resume) a frozen protocol: every arm at every seed, as MLflow child runs."""
    if storage:
        check_optuna_storage(storage)  # before any MLflow run exists
    try:
        protocol = open_protocol(protocol_path, allow_dirty)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    if storage:
        from studies.cell_queue import enqueue_cells, open_storage, redact

        parent = start_parent_run(protocol, Path(protocol_path), allow_dirty, {"queue": "optuna"})
        name, added = enqueue_cells(protocol, Path(protocol_path), open_storage(storage), parent, set(),
                                    {"allow_dirty": allow_dirty, "download": download})
        click.echo(f"queued {added} cells in {name}; parent run {parent}. Start workers with:\n"
                   f"  workbench worker --storage {redact(storage)} --study '{name}'")
        return
    check_protocol_amp(protocol, device)  # here, not when queuing: workers check their own device
    outcomes = run_protocol(protocol, Path(protocol_path), Path(output_dir), device, data_path, allow_dirty, download)
    summarize(outcomes)
    if any(o.status == "failed" for o in outcomes):
        sys.exit(1)


def summarize(outcomes: list[CellOutcome]) -> None:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed")}
    click.echo(f"cells: {counts['finished']} run, {counts['skipped']} already finished (skipped), {counts['failed']} failed")
    for o in outcomes:
        if o.status == "failed":
            click.echo(f"  FAILED {o.message}", err=True)
