"""Protocol cells as an Optuna study that any number of workers drain.

``ablate --storage URL`` enqueues each cell that has no finished MLflow run as an Optuna
trial with a fixed parameter ``cell`` (its index in ``Protocol.cells()``). Workers
(``workbench worker --storage URL``) pop waiting trials through ``study.optimize``, which
records heartbeats on RDB storage; the trial of a killed worker goes stale and
``RetryFailedTrialCallback`` puts a copy back in the queue. The MLflow side stays
exactly-once because a cell's run is found by its identity key: a retried cell continues
the dead worker's run (and its checkpoint when the output folder is shared).

JournalStorage (a shared file) works too but has no heartbeats in Optuna: there, a dead
worker's cell stays RUNNING until ``workbench worker --requeue-stale`` is run.
"""

from __future__ import annotations

import time
from pathlib import Path

import warnings

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

try:  # Optuna >= 4.9 renamed the retry callback
    from optuna.storages import RetryHeartbeatStaleTrialCallback as RetryStale
except ImportError:  # pragma: no cover - older Optuna
    from optuna.storages import RetryFailedTrialCallback as RetryStale

# Heartbeats are "experimental" in Optuna's terms; the warning adds nothing for users here.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

from studies.protocol import Protocol, load_protocol

HEARTBEAT_SECONDS = 10
GRACE_SECONDS = 30
MAX_RETRIES = 3


def open_storage(url: str, heartbeat: int = HEARTBEAT_SECONDS, grace: int = GRACE_SECONDS):
    """RDB storage with heartbeats (PostgreSQL, MySQL, SQLite URL) or a journal file."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    if url.startswith("sqlite:") and "mlflow" in Path(url.split("///")[-1]).name:
        raise ValueError(f"{url}: never share MLflow's SQLite file with Optuna; use a database of its own")
    return RDBStorage(
        url, heartbeat_interval=heartbeat, grace_period=grace,
        heartbeat_stale_trial_callback=RetryStale(max_retry=MAX_RETRIES),
        engine_kwargs={"pool_pre_ping": True},
    )


def redact(url: str) -> str:
    """A storage URL safe to print or log: the password replaced by ***."""
    if url.startswith("journal:"):
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def study_name_for(protocol: Protocol) -> str:
    return f"cells:{protocol.name}@{protocol.short_hash}"


def enqueue_cells(protocol: Protocol, protocol_file: Path, storage, parent_run_id: str, finished: set[tuple[str, int]],
                  settings: dict) -> tuple[str, int]:
    """Put every cell without a finished run into the queue, once. Returns (study name, cells enqueued)."""
    name = study_name_for(protocol)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
    study.set_user_attr("protocol_file", str(protocol_file))
    study.set_user_attr("protocol_hash", protocol.hash)
    study.set_user_attr("parent_run_id", parent_run_id)
    study.set_user_attr("settings", settings)
    # A cell already waiting, running or done in the queue is not added again.
    queued = {
        t.user_attrs.get("cell")
        for t in study.get_trials(deepcopy=False)
        if t.state in (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
    }
    added = 0
    for index, cell in enumerate(protocol.cells()):
        if (cell.arm, cell.seed) in finished or index in queued:
            continue
        study.enqueue_trial({"cell": index}, user_attrs={"cell": index, "arm": cell.arm, "seed": cell.seed})
        added += 1
    return name, added


def counts(study: optuna.Study) -> dict[str, int]:
    trials = study.get_trials(deepcopy=False)
    return {state.name.lower(): sum(t.state == state for t in trials) for state in TrialState}


def load_queued_protocol(study: optuna.Study) -> Protocol:
    """The protocol the queue was made from; refuse a checkout whose file has another hash."""
    attrs = study.user_attrs
    protocol = load_protocol(attrs["protocol_file"])
    if protocol.hash != attrs["protocol_hash"]:
        raise ValueError(
            f"{attrs['protocol_file']} has hash {protocol.short_hash} here but the queue holds "
            f"{attrs['protocol_hash'][:12]}: check out the commit the protocol was queued from"
        )
    return protocol


def drain(study: optuna.Study, run_one, poll_seconds: float = 2.0, max_cells: int | None = None,
          log=print) -> int:
    """Run queued cells until none is waiting or running. ``run_one(index) -> float`` trains one.

    Returns the number of cells this worker ran.
    """
    done = 0

    def objective(trial: optuna.Trial) -> float:
        if "cell" not in trial.user_attrs:
            # Another worker took the last waiting cell between our check and optimize().
            raise optuna.TrialPruned("no queued cell")
        return run_one(trial.suggest_int("cell", 0, 10**6))

    while max_cells is None or done < max_cells:
        state = counts(study)
        if state["waiting"]:
            study.optimize(objective, n_trials=1, catch=(Exception,))
            last = study.get_trials(deepcopy=False)[-1]
            done += last.state != TrialState.PRUNED
            continue
        if not state["running"]:
            break
        # Cells are running elsewhere; if one of those workers died its heartbeat stops,
        # the trial goes stale and a retry copy appears as waiting.
        optuna.storages.fail_stale_trials(study)
        time.sleep(poll_seconds)
    return done
