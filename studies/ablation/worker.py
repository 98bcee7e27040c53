"""Entry point: a worker that pops protocol cells from an Optuna queue and trains each exactly once."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from unittest.mock import patch

import click
import optuna
from optuna.trial import TrialState

from studies.ablation.ablate import run_cell
from studies.ablation.cell_queue import (
    CELL_ATTR,
    GRACE_SECONDS,
    HEARTBEAT_SECONDS,
    OUTCOME_ATTR,
    CellQueue,
    check_timing,
    counts,
    hand_back,
    holds,
    load_queued_protocol,
    new_lease,
    open_storage,
    renew,
    requeue_expired,
)
from studies.runtime.kernel_match import (
    MATCH_ENV,
    KernelsCannotMatch,
    KernelsToMatch,
    restart_with,
)
from studies.runtime.options import (
    FiniteFloat,
    StudyOptions,
    check_protocol_amp,
    check_storage_option,
    threads_option,
)
from studies.runtime.preflight import check_writable_folder
from studies.runtime.secret_options import storage_options
from studies.ablation.preemption import PREEMPTED_EXIT
from studies.runtime.stop_signals import Preempted, pending_stop, sigterm_raises
from studies.runtime.study_execution import held_parent, prepare_protocol_data
from tracking.record.lease import HEARTBEAT_ENV, HEARTBEATS, LEASE_ENV, LeaseLost
from tracking.store.session import configure_tracking
from workbench.precision import set_threads
from workbench.train.loop import TrainingObserver


def pick_study(storage, name: str | None) -> CellQueue:
    names = [
        s.study_name
        for s in optuna.get_all_study_summaries(storage)
        if s.study_name.startswith("cells:")
    ]
    if name is None:
        if len(names) != 1:
            raise click.ClickException(
                f"pass --study: the storage holds {len(names)} cell queues: {', '.join(names) or 'none'}"
            )
        name = names[0]
    if name not in names:
        raise click.ClickException(
            f"no cell queue {name!r} in the storage; it holds: {', '.join(names) or 'none'}"
        )
    return CellQueue.load(name, storage)


class QueueFence(TrainingObserver):
    """Stops the cell (``LeaseLost``) as soon as its trial is no longer this worker's."""

    def __init__(self, queue: CellQueue, number: int, lease: dict) -> None:
        self.queue, self.number, self.lease, self.lost = queue, number, lease, None

    def beat(self) -> None:
        if self.lost is None:
            try:
                renew(self.queue, self.number, self.lease)
            except Exception:  # noqa: BLE001 - a finished trial refuses the write: read why
                self.lost = holds(self.queue, self.number, self.lease)

    def check(self, sync: bool = False) -> None:
        if sync and self.lost is None:
            self.lost = holds(self.queue, self.number, self.lease)
        if self.lost:
            raise LeaseLost(self.lost)


def drain(
    queue: CellQueue,
    run_one,
    grace: float,
    poll_seconds: float = 2.0,
    max_cells: int | None = None,
    log=click.echo,
    tally: dict | None = None,
) -> dict[str, int]:
    """Pop and run queued cells until none is waiting or running anywhere; re-queue expired leases.

    ``run_one(trial, fence) -> (outcome status, value)``. Returns this worker's tally
    (``tally``, when given, is filled in place as cells end: a Ctrl-C leaves it as far as it got).
    """
    tally = {} if tally is None else tally
    tally.update({"ran": 0, "skipped": 0, "failed": 0, "lost": 0})
    waiting_said = None
    while max_cells is None or tally["ran"] + tally["failed"] < max_cells:
        if pending_stop() is not None:  # never take another cell after Ctrl-C or SIGTERM
            raise pending_stop()
        requeue_expired(queue, grace, log)
        state = counts(queue)
        if not state["waiting"]:
            if not state["running"]:
                break
            if waiting_said != state["running"]:  # say it once per change, not every poll
                log(
                    f"waiting: {state['running']} cell(s) running on other workers; a lease expired after "
                    f"{grace:g} s is taken over"
                )
                waiting_said = state["running"]
            time.sleep(poll_seconds)
            continue
        waiting_said = None
        trial = queue.study.ask()
        if CELL_ATTR not in trial.user_attrs:  # another worker popped the last waiting cell first
            queue.study.tell(trial, state=TrialState.PRUNED)
            continue
        # The lease names this worker: from now on the queue's record says which cell it holds.
        lease = new_lease()
        renew(queue, trial.number, lease)
        fence = QueueFence(queue, trial.number, lease)
        HEARTBEATS.also("queue", fence.beat)
        try:
            status, value = run_one(trial, fence)
        except (
            Preempted
        ) as stop:  # the cell's checkpoint is up and its run released: give it back now
            HEARTBEATS.also("queue", None)
            given = hand_back(queue, trial.number, lease, f"preempted ({stop})")
            log(
                f"cell {trial.user_attrs[CELL_ATTR]}: preempted ({stop}); "
                + (
                    "handed back to the queue: the next worker resumes it from its uploaded checkpoint"
                    if given
                    else "another worker holds it already"
                )
            )
            raise
        finally:
            HEARTBEATS.also("queue", None)
        why = fence.lost or holds(queue, trial.number, lease)
        if status == "lost" or why:
            tally["lost"] += 1
            log(
                f"cell {trial.user_attrs[CELL_ATTR]}: stopped, lease lost: {why}; another worker has it"
            )
            continue
        # What became of the cell, in the queue's record: `ablate --jobs` counts it from there
        # (a skipped cell completes too), and a trial with an outcome is held by nobody.
        queue.set_attr(trial.number, OUTCOME_ATTR, status)
        if status == "failed":
            queue.study.tell(trial, state=TrialState.FAIL)
            tally["failed"] += 1
        else:
            queue.study.tell(trial, value)
            tally["skipped" if status == "skipped" else "ran"] += 1
    else:
        tally["stopped"] = f"stopped at --max-cells {max_cells}"
    return tally


@click.command("worker")
@storage_options(
    required=True,
    help="Optuna storage URL (postgresql://user@host/optuna, sqlite:///queue.db, "
    "journal:/shared/queue.log).",
)
@click.option(
    "--study",
    "study_name",
    default=None,
    help="Cell queue name (cells:<protocol>@<hash>); default: the only one.",
)
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None, help="Where this machine keeps the dataset.")
@click.option(
    "--output-dir", type=click.Path(file_okay=False), default="outputs/ablate", show_default=True
)
@click.option("--max-cells", type=int, default=None, help="Stop after this many cells.")
@click.option(
    "--requeue-stale",
    is_flag=True,
    help="Re-queue the cells whose worker's lease expired, then go on (workers also do this by themselves).",
)
@click.option(
    "--heartbeat",
    type=FiniteFloat(min=0.1),
    default=HEARTBEAT_SECONDS,
    show_default=True,
    help="Seconds between lease renewals.",
)
@click.option(
    "--grace",
    type=FiniteFloat(min=0.5),
    default=GRACE_SECONDS,
    show_default=True,
    help="A cell whose lease was not renewed for this long is handed to another worker.",
)
@click.option(
    "--default-threads",
    type=click.IntRange(min=1),
    default=None,
    hidden=True,
    help="Threads for new cells when --threads is not given (ablate --jobs); resumed cells keep theirs.",
)
@click.option(
    "--match-kernels",
    is_flag=True,
    help="A cell another machine began runs on its first machine's CPU kernels: this worker starts "
    "itself again under the ATen/oneDNN/MKL caps its record calls for, or hands it back and stops "
    'where no cap reaches them (docs/remote.md, "Kernels").',
)
@threads_option
def worker(
    storage,
    study_name,
    device,
    data_path,
    output_dir,
    max_cells,
    requeue_stale,
    heartbeat,
    grace,
    match_kernels,
    threads,
    default_threads,
):
    """Pop queued protocol cells and train them until the queue is empty."""
    if not threads and default_threads:
        set_threads(default_threads)
    check_storage_option(storage)
    try:
        check_timing(heartbeat, grace)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--heartbeat") from err
    check_writable_folder(output_dir)  # before a cell is popped, not at its first checkpoint
    # The cells' MLflow runs carry the same lease timing as the queue, for this command only
    # (invoked in-process, from a notebook or a test, it must not change later leases).
    settings = {LEASE_ENV: str(grace), HEARTBEAT_ENV: str(heartbeat)}
    if match_kernels:
        settings[MATCH_ENV] = "1"
    with patch.dict(os.environ, settings), preempted_exit():
        drain_queue(
            storage,
            study_name,
            device,
            data_path,
            output_dir,
            max_cells,
            requeue_stale,
            heartbeat,
            grace,
            threads,
        )


@contextlib.contextmanager
def preempted_exit():
    """A preempted worker (SIGTERM, SIGUSR1) exits with ``PREEMPTED_EXIT`` and one line, so a
    scheduler requeues it (docs/remote.md, "Preemption"); any other stop keeps its exit."""
    try:
        yield
    except KernelsToMatch as stop:  # its cell is back in the queue: take it again on its kernels
        try:
            restart_with(stop.caps, click.echo)
        except RuntimeError as err:
            raise click.ClickException(f"{stop.cell}: --match-kernels: {err}") from None
    except KernelsCannotMatch as stop:
        raise click.ClickException(
            f"{stop} (the cell is back in the queue for a machine that can run its kernels)"
        ) from None
    except Preempted as stop:
        click.echo(
            f"worker preempted ({stop}): its cell is checkpointed and back in the queue; exit {PREEMPTED_EXIT}"
        )
        raise click.exceptions.Exit(PREEMPTED_EXIT) from None


def drain_queue(
    storage,
    study_name,
    device,
    data_path,
    output_dir,
    max_cells,
    requeue_stale,
    heartbeat,
    grace,
    threads=0,
):
    """The worker's work: pick the queue, prepare the data, hold the parent, drain the cells."""
    configure_tracking()
    store = open_storage(storage, heartbeat, grace)
    queue = pick_study(store, study_name)
    study = queue.study
    if requeue_stale:
        click.echo(
            f"re-queued {requeue_expired(queue, grace, click.echo)} cells whose lease expired"
        )
    protocol = load_queued_protocol(study)
    check_protocol_amp(protocol, device)
    settings = study.user_attrs.get("settings", {})
    allow_dirty = settings.get("allow_dirty", False)
    data = prepare_protocol_data(protocol, data_path, settings.get("download", False))

    with (
        sigterm_raises(preemptible=True),
        held_parent(
            protocol,
            Path(study.user_attrs["protocol_file"]),
            allow_dirty,
            {"queue": "optuna"},
            queued=True,
            record_run=study.user_attrs.get("parent_run_id"),
        ) as parent,
    ):

        def run_one(trial, fence) -> tuple[str, float]:
            index = trial.user_attrs[CELL_ATTR]
            cell = protocol.cells()[index]
            click.echo(f"cell {index}: {cell.key} (took it from the queue)")
            outcome = run_cell(
                protocol,
                cell,
                data=data,
                parent_run_id=parent.run_id,
                options=StudyOptions(
                    output_dir=Path(output_dir),
                    device=device,
                    data_path=data_path,
                    allow_dirty=allow_dirty,
                    threads=threads,
                ),
                observer=fence,
                take_over=True,
                log=click.echo,
            )
            click.echo(f"[{outcome.status}] {outcome.message}")
            return outcome.status, outcome.metrics.get("best_val_accuracy", float("nan"))

        parent.work = {}  # the record says what this worker trained (tracking.record.executions.work_line)
        tally = drain(
            queue,
            run_one,
            grace,
            poll_seconds=min(2.0, heartbeat),
            max_cells=max_cells,
            tally=parent.work,
        )
    click.echo(
        f"worker ran {tally['ran']} cells ({tally['skipped']} already finished, {tally['failed']} failed, "
        f"{tally['lost']} lost to another worker); queue: {counts(queue)}"
    )
