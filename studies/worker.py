"""Entry point: a worker that pops protocol cells from an Optuna queue and trains them."""

from __future__ import annotations

from pathlib import Path

import click
import optuna
from optuna.trial import TrialState

from studies.ablate import prepare_protocol_data, run_cell
from studies.cell_queue import GRACE_SECONDS, HEARTBEAT_SECONDS, counts, drain, load_queued_protocol, open_storage
from studies.options import check_protocol_amp, threads_option
from tracking.protocols import end_parent_run, parent_status
from tracking.runs import configure_tracking
from tracking.storage_guard import check_optuna_storage


def pick_study(storage, name: str | None) -> optuna.Study:
    names = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("cells:")]
    if name is None:
        if len(names) != 1:
            raise click.ClickException(f"pass --study: the storage holds {len(names)} cell queues: {', '.join(names) or 'none'}")
        name = names[0]
    if name not in names:
        raise click.ClickException(f"no cell queue {name!r} in the storage; it holds: {', '.join(names) or 'none'}")
    return optuna.load_study(study_name=name, storage=storage)


def requeue_running(study: optuna.Study) -> int:
    """For storages without heartbeats: fail RUNNING trials and queue their cells again."""
    n = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial({"cell": trial.user_attrs["cell"]}, user_attrs=trial.user_attrs)
        n += 1
    return n


@click.command("worker")
@click.option("--storage", required=True, help="Optuna storage URL (postgresql://..., sqlite:///queue.db, journal:/shared/queue.log).")
@click.option("--study", "study_name", default=None, help="Cell queue name (cells:<protocol>@<hash>); default: the only one.")
@click.option("--device", default="auto", show_default=True)
@click.option("--data-path", default=None, help="Where this machine keeps the dataset.")
@click.option("--output-dir", type=click.Path(file_okay=False), default="outputs/ablate", show_default=True)
@click.option("--max-cells", type=int, default=None, help="Stop after this many cells.")
@click.option("--requeue-stale", is_flag=True, help="Journal storage only: re-queue cells left RUNNING by dead workers.")
@click.option("--heartbeat", type=click.IntRange(min=1), default=HEARTBEAT_SECONDS, show_default=True,
              help="Seconds between heartbeats (RDB storage).")
@click.option("--grace", type=click.IntRange(min=1), default=GRACE_SECONDS, show_default=True,
              help="A running cell without a heartbeat for this long is retried.")
@threads_option
def worker(storage, study_name, device, data_path, output_dir, max_cells, requeue_stale, heartbeat, grace, threads):
    """Pop queued protocol cells and train them until the queue is empty."""
    check_optuna_storage(storage)
    configure_tracking()
    store = open_storage(storage, heartbeat, grace)
    study = pick_study(store, study_name)
    if requeue_stale:
        click.echo(f"re-queued {requeue_running(study)} running cells")
    protocol = load_queued_protocol(study)
    check_protocol_amp(protocol, device)
    settings = study.user_attrs.get("settings", {})
    parent = study.user_attrs["parent_run_id"]
    data = prepare_protocol_data(protocol, data_path, settings.get("download", False))

    def run_one(index: int) -> float:
        cell = protocol.cells()[index]
        click.echo(f"cell {index}: {cell.key}")
        outcome = run_cell(protocol, cell, data, parent, Path(output_dir), device, data_path,
                           settings.get("allow_dirty", False))
        click.echo(f"[{outcome.status}] {outcome.message}")
        if outcome.status == "failed":
            raise RuntimeError(outcome.message)
        return outcome.metrics.get("best_val_accuracy", float("nan"))

    ran = drain(study, run_one, max_cells=max_cells)
    state = counts(study)
    click.echo(f"worker ran {ran} cells; queue: {state}")
    if not state["waiting"] and not state["running"]:
        # None: the server is away now; the parent is then closed through a local mirror.
        if parent_status(parent) in ("RUNNING", None):
            # A stale trial that was retried and then completed is not a failed cell.
            trials = study.get_trials(deepcopy=False)
            complete = {t.user_attrs.get("cell") for t in trials if t.state == TrialState.COMPLETE}
            failed = {t.user_attrs.get("cell") for t in trials if t.state == TrialState.FAIL} - complete
            end_parent_run(parent, {"finished": len(complete), "failed": len(failed)}, protocol.name)
