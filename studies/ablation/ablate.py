"""Entry point: run a frozen protocol's arms x seeds as MLflow child runs.

Resuming is running the same command again: cells whose finished run exists (same
protocol hash, arm, seed, code fingerprint and data fingerprint) are skipped, an interrupted
cell continues from its checkpoint in its own MLflow run, and the rest run. In this process
the cells are a study kind (``AblationStudy``) run by the driver every kind shares
(``studies.runtime.study_kind``); ``--jobs`` and ``--storage`` hand them to workers instead.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import replace
from pathlib import Path

import click

from studies.ablation.jobs import DEFAULT_THREADS_PER_JOB, check_jobs, describe, run_jobs
from studies.ablation.status import older_code_notice
from studies.ablation.train import train_one
from studies.runtime.cell_end import StoreUnwritable
from studies.runtime.options import (
    StudyOptions,
    check_protocol_amp,
    check_storage_option,
    study_options,
)
from studies.runtime.outcome import CellOutcome, Status
from studies.runtime.secret_options import storage_options, worker_hint
from studies.runtime.stop_signals import as_stop
from studies.runtime.study_execution import finished_cells, held_parent, prepare_checked_data
from studies.runtime.study_kind import StudyKind, open_study, run_cells, run_study, said_in_one_line
from studies.runtime.study_protocol import Cell, Protocol, load_protocol
from tracking.record.protocol_runs import cell_runs
from tracking.store.store_errors import explain
from tracking.record.schema import cell_tags
from workbench.data import DatasetNotFound, PreparedData
from workbench.train.fingerprint import current_code_fingerprint

DEFAULT_PROTOCOL = "studies/protocols/smoke.yaml"


class AblationStudy(StudyKind):
    """An ablation protocol's arms x seeds, trained one after another in this process."""

    user_errors = StudyKind.user_errors + (DatasetNotFound,)

    def __init__(self, options: StudyOptions, arms: tuple[str, ...] = ()) -> None:
        self.options = options
        self.arms = arms
        self.data: PreparedData | None = None

    def cells(self, protocol: Protocol) -> list[Cell]:
        """The protocol's cells, or only those of ``--arms`` when given (the others stay to run later)."""
        return [c for c in protocol.cells() if not self.arms or c.arm in self.arms]

    @classmethod
    def load(cls, path: str) -> Protocol:
        return load_protocol(path)

    @classmethod
    def notice(cls, protocol: Protocol) -> str | None:
        return older_code_notice(
            protocol, cell_runs(protocol.name, protocol.hash), current_code_fingerprint()
        )

    def prepare(self, protocol: Protocol, protocol_file: Path, options: StudyOptions) -> str:
        self.protocol, data = (
            protocol,
            prepare_checked_data(protocol, options.data_path, options.download),
        )
        self.data = data
        return (
            f"{protocol.name}@{protocol.short_hash}: {len(protocol.cells())} cells on {data.display_name} "
            f"({len(data.train.labels)} train / {len(data.val.labels)} val), data {data.data_fingerprint[:12]}"
        )

    def run_cell(self, cell: Cell, parent) -> CellOutcome:
        return run_cell(
            self.protocol, cell, data=self.data, parent_run_id=parent.run_id, options=self.options
        )


def open_protocol(path: str, allow_dirty: bool) -> Protocol:
    """Load, check committed-ness and frozen hash; errors name the file or key (``open_study``)."""
    return open_study(AblationStudy, path, allow_dirty)


def cell_identity(cell: Cell) -> dict:
    """What makes a cell's run the same run (docs/architecture.md, the ``ablate`` flow, step 8).

    The code enters through its fingerprint (``workbench.train.fingerprint``), not the git
    commit: a commit touching only docs, reports, CLI text or tests re-trains nothing.
    """
    return {
        "protocol_hash": cell.protocol_hash,
        "arm": cell.arm,
        "seed": cell.seed,
        "code_fingerprint": current_code_fingerprint(),
    }


def run_cell(
    protocol: Protocol,
    cell: Cell,
    *,
    data: PreparedData,
    parent_run_id: str,
    options: StudyOptions,
    **train_kw,
) -> CellOutcome:
    """Train one cell as a child run; any exception becomes a failed outcome, not a crash.

    ``train_kw`` go to ``train_one`` (a worker's queue fence as ``observer``, ``take_over``, ``log``).
    """
    tags = cell_tags(
        protocol_name=protocol.name,
        protocol_hash=protocol.hash,
        arm=cell.arm,
        seed=cell.seed,
        is_reference=cell.is_reference,
        allow_dirty=options.allow_dirty,
    )
    try:
        outcome = train_one(
            cell.train_config(device=options.device, data_path=options.data_path),
            data,
            experiment=protocol.name,
            output_dir=options.output_dir / protocol.name,
            run_name=f"{cell.arm}-seed{cell.seed}",
            parent_run_id=parent_run_id,
            identity=cell_identity(cell),
            tags=tags,
            params={"arm": cell.arm, "seed": cell.seed},
            threads=options.threads,
            **train_kw,
        )
    except StoreUnwritable as err:  # the cell's run ended as far as the store let it: name the cell
        raise StoreUnwritable(f"{cell.key}: {err.message}") from err.__cause__
    except Exception as err:  # one failing cell must not take the others down
        stop = as_stop(err)
        if stop is not err:  # a Ctrl-C or SIGTERM that came out as another error: stop
            raise stop from err
        store_problem = explain(err)
        if (
            store_problem
        ):  # a full or read-only store: every later cell would train, then fail the same way
            raise StoreUnwritable(f"{cell.key}: {store_problem}") from err
        traceback.print_exc()
        return CellOutcome(cell, Status.FAILED, f"{cell.key}: failed ({type(err).__name__}: {err})")
    return replace(outcome, cell=cell)


def arm_order(protocol: Protocol, arms: tuple[str, ...]) -> list[int] | None:
    """Indices of the cells of ``arms`` in protocol order (None: every cell)."""
    if not arms:
        return None
    return [i for i, c in enumerate(protocol.cells()) if c.arm in arms]


def check_arms(protocol: Protocol, protocol_path: str, arms: tuple[str, ...]) -> None:
    """Refuse an ``--arms`` name the protocol does not have, naming it and the file, before any run opens."""
    known = [a.name for a in protocol.arms]
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise click.BadParameter(
            f"{protocol_path} has no arm {', '.join(map(repr, unknown))} (its arms: {', '.join(known)})",
            param_hint="--arms",
        )


def run_protocol(
    protocol: Protocol, protocol_file: Path, options: StudyOptions
) -> list[CellOutcome]:
    """Run every cell of ``protocol`` in this process, under the study's one parent run (``run_cells``)."""
    return run_cells(AblationStudy(options), protocol, protocol_file, options)


@click.command("ablate")
@click.option(
    "--protocol",
    "protocol_path",
    default=DEFAULT_PROTOCOL,
    show_default=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Protocol YAML file.",
)
@study_options("outputs/ablate", "Checkpoints and predictions of each cell.")
@storage_options(
    required=False,
    from_env=False,
    help="Optuna storage URL: queue the cells there for `workbench worker` instead of running them here.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Train this many cells at once here, each in a worker process of its own with --threads threads "
    f"(default {DEFAULT_THREADS_PER_JOB} per job), through the cell queue; 0: one cell after another in "
    "this process.",
)
@click.option(
    "--arms",
    "arm_names",
    default="",
    help="Comma-separated arm names: run only these arms' cells now (the others stay unfinished, for a "
    "later ablate). The cells and their identity are the protocol's, whichever arms run first.",
)
def ablate(protocol_path, options: StudyOptions, storage, jobs, arm_names):
    """Run (or resume) a frozen protocol: every arm at every seed, as MLflow child runs."""
    check_jobs(jobs, storage)
    if storage:
        check_storage_option(storage)  # before any MLflow run exists
    with said_in_one_line(AblationStudy):
        protocol = open_protocol(protocol_path, options.allow_dirty)
    arms = tuple(a.strip() for a in arm_names.split(",") if a.strip())
    check_arms(protocol, protocol_path, arms)
    if storage:
        queue_cells(protocol, Path(protocol_path), storage, options, arms)
        return
    # here, not when queuing: workers check their own device
    check_protocol_amp(protocol, options.device)
    if jobs:
        tally = run_jobs(protocol, Path(protocol_path), options, jobs=jobs, arms=arms)
        click.echo(describe(tally))
        if (
            tally["failed"] or tally["unfinished"]
        ):  # a worker that died and was replaced is not a failed study
            sys.exit(1)
        return
    run_study(AblationStudy(options, arms), protocol, Path(protocol_path), options)


def queue_cells(
    protocol: Protocol,
    protocol_file: Path,
    storage: str,
    options: StudyOptions,
    arms: tuple[str, ...] = (),
) -> None:
    """``--storage``: the unfinished cells queued in an Optuna study for ``workbench worker``, under the parent."""
    from studies.ablation.cell_queue import enqueue_cells, open_storage

    try:  # the workers load the data where they run; when it is here too, check it before queuing
        prepare_checked_data(protocol, options.data_path, download=False)
    except DatasetNotFound:
        click.echo(
            f"{protocol.dataset.name} is not on this machine: each worker checks the arms against "
            "its data before training",
            err=True,
        )
    # Optuna's tables first, before the parent is touched: a storage that fails (unreachable,
    # another Optuna's schema) leaves the study's record as it was.
    queue = open_storage(storage)
    with held_parent(
        protocol, protocol_file, options.allow_dirty, {"queue": "optuna"}, queued=True
    ) as parent:
        name, added = enqueue_cells(
            protocol,
            protocol_file,
            queue,
            parent.run_id,
            finished_cells(protocol),
            {"allow_dirty": options.allow_dirty, "download": options.download},
            arm_order(protocol, arms),
        )
    click.echo(
        f"queued {added} cells in {name}; parent run {parent.run_id}. {worker_hint(storage, name)}"
    )
