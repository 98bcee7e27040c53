"""Entry point: run a frozen protocol's arms x seeds as MLflow child runs.

Resuming is running the same command again: cells whose finished run exists (same
protocol hash, arm, seed, code fingerprint and data fingerprint) are skipped, an interrupted
cell continues from its checkpoint in its own MLflow run, and the rest run.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import click
from tqdm.auto import tqdm

from studies.ablation.jobs import DEFAULT_THREADS_PER_JOB, check_jobs, describe, run_jobs
from studies.ablation.status import older_code_notice
from studies.ablation.train import TrainOutcome, train_one
from studies.runtime.options import check_protocol_amp, check_storage_option, threads_option
from studies.runtime.secret_options import storage_options, worker_hint
from studies.runtime.stop_signals import as_stop, sigterm_raises
from studies.runtime.study_execution import finished_cells, held_parent, prepare_checked_data
from studies.runtime.study_protocol import Cell, Protocol, ProtocolError, check_clean, check_frozen, load_protocol
from tracking.record.protocol_runs import cell_runs, frozen_hashes
from tracking.store.session import configure_tracking
from studies.runtime.cell_end import StoreUnwritable
from tracking.store.store_errors import explain
from workbench.data import DatasetNotFound, PreparedData
from workbench.train.fingerprint import current_code_fingerprint

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
    check_frozen(protocol, frozen_hashes(protocol.name))
    notice = older_code_notice(protocol, cell_runs(protocol.name, protocol.hash), current_code_fingerprint())
    if notice:
        click.echo(notice)
    return protocol


def cell_identity(cell: Cell) -> dict:
    """What makes a cell's run the same run: see DESIGN.md, 'Data flow of the main job'.

    The code enters through its fingerprint (``workbench.train.fingerprint``), not the git
    commit: a commit touching only docs, reports, CLI text or tests re-trains nothing.
    """
    return {"protocol_hash": cell.protocol_hash, "arm": cell.arm, "seed": cell.seed,
            "code_fingerprint": current_code_fingerprint()}


def run_cell(
    protocol: Protocol, cell: Cell, data: PreparedData, parent_run_id: str, output_dir: Path,
    device: str = "auto", data_path: str | None = None, allow_dirty: bool = False, **train_kw,
) -> CellOutcome:
    """Train one cell as a child run; any exception becomes a failed outcome, not a crash.

    ``train_kw`` go to ``train_one`` (``threads``: the count the user asked for, 0 for none).
    """
    tags = {"cell": "true", "protocol_name": protocol.name, "protocol_hash": protocol.hash, "arm": cell.arm,
            "seed": str(cell.seed), "is_reference": str(cell.is_reference).lower(),
            "allow_dirty": str(allow_dirty).lower()}
    try:
        outcome: TrainOutcome = train_one(
            cell.train_config(device=device, data_path=data_path), data, protocol.name,
            output_dir / protocol.name, run_name=f"{cell.arm}-seed{cell.seed}", parent_run_id=parent_run_id,
            identity=cell_identity(cell), tags=tags, params={"arm": cell.arm, "seed": cell.seed}, **train_kw,
        )
    except Exception as err:  # one failing cell must not take the others down
        stop = as_stop(err)
        if stop is not err:  # a Ctrl-C or SIGTERM that came out as another error: stop
            raise stop from err
        store_problem = explain(err)
        if store_problem:  # a full or read-only store: every later cell would train, then fail the same way
            raise StoreUnwritable(f"{cell.key}: {store_problem}") from err
        traceback.print_exc()
        return CellOutcome(cell, "failed", f"{cell.key}: failed ({type(err).__name__}: {err})")
    return CellOutcome(cell, outcome.status, outcome.message, outcome.run_id, outcome.metrics)


def run_protocol(
    protocol: Protocol, protocol_file: Path, output_dir: Path, device: str = "auto",
    data_path: str | None = None, allow_dirty: bool = False, download: bool = False, threads: int = 0,
) -> list[CellOutcome]:
    """Run every cell of ``protocol`` in this process, under the study's one parent run."""
    data = prepare_checked_data(protocol, data_path, download)
    tqdm.write(f"{protocol.name}@{protocol.short_hash}: {len(protocol.cells())} cells on {data.display_name} "
               f"({len(data.train.labels)} train / {len(data.val.labels)} val), data {data.data_fingerprint[:12]}")
    outcomes = []
    with sigterm_raises(), held_parent(protocol, protocol_file, allow_dirty) as parent:
        with tqdm(protocol.cells(), desc=f"{protocol.name} cells", unit="cell") as bar:
            for cell in bar:
                bar.set_postfix_str(cell.key)
                outcome = run_cell(protocol, cell, data, parent.run_id, output_dir, device, data_path, allow_dirty,
                                   threads=threads)
                tqdm.write(f"[{outcome.status}] {outcome.message}")
                outcomes.append(outcome)
    if parent.status == "FAILED" and not any(o.status == "failed" for o in outcomes):
        # The exit status agrees with the record (before: `parent run ...: FAILED` and exit 0).
        cells = ", ".join(f"{n} {what}" for what, n in (parent.execution.get("cells") or {}).items() if n)
        raise click.ClickException(f"parent run {parent.run_id} ended FAILED (cells: {cells or 'none counted'})")
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
@storage_options(required=False, from_env=False,
                 help="Optuna storage URL: queue the cells there for `workbench worker` instead of running them here.")
@click.option("--jobs", type=click.IntRange(min=0), default=0, show_default=True,
              help="Train this many cells at once here, each in a worker process of its own with --threads threads "
                   f"(default {DEFAULT_THREADS_PER_JOB} per job), through the cell queue; 0: one cell after another in "
                   "this process.")
@threads_option
def ablate(protocol_path, allow_dirty, device, data_path, download, output_dir, storage, threads, jobs):
    """Run (or resume) a frozen protocol: every arm at every seed, as MLflow child runs."""
    check_jobs(jobs, storage)
    if storage:
        check_storage_option(storage)  # before any MLflow run exists
    try:
        protocol = open_protocol(protocol_path, allow_dirty)
    except ProtocolError as err:
        raise click.ClickException(str(err)) from err
    if storage:
        from studies.ablation.cell_queue import enqueue_cells, open_storage

        try:  # the workers load the data where they run; when it is here too, check it before queuing
            prepare_checked_data(protocol, data_path, download=False)
        except DatasetNotFound:
            click.echo(f"{protocol.dataset.name} is not on this machine: each worker checks the arms against "
                       "its data before training", err=True)
        # Optuna's tables first, before the parent is touched: a storage that fails (unreachable,
        # another Optuna's schema) leaves the study's record as it was.
        queue = open_storage(storage)
        with held_parent(protocol, Path(protocol_path), allow_dirty, {"queue": "optuna"}, queued=True) as parent:
            name, added = enqueue_cells(protocol, Path(protocol_path), queue, parent.run_id,
                                        finished_cells(protocol), {"allow_dirty": allow_dirty, "download": download})
        click.echo(f"queued {added} cells in {name}; parent run {parent.run_id}. {worker_hint(storage, name)}")
        return
    check_protocol_amp(protocol, device)  # here, not when queuing: workers check their own device
    if jobs:
        tally = run_jobs(protocol, Path(protocol_path), Path(output_dir), jobs, threads, device, data_path,
                         allow_dirty, download)
        click.echo(describe(tally))
        if tally["failed"] or tally["unfinished"]:  # a worker that died and was replaced is not a failed study
            sys.exit(1)
        return
    outcomes = run_protocol(protocol, Path(protocol_path), Path(output_dir), device, data_path, allow_dirty, download,
                            threads)
    summarize(outcomes)
    if any(o.status == "failed" for o in outcomes):
        sys.exit(1)


def summarize(outcomes: list[CellOutcome]) -> None:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed", "busy")}
    click.echo(f"cells: {counts['finished']} run, {counts['skipped']} already finished (skipped), {counts['failed']} failed"
               + (f", {counts['busy']} running elsewhere" if counts["busy"] else ""))
    for o in outcomes:
        if o.status == "failed":
            click.echo(f"  FAILED {o.message}", err=True)
