"""Protocol cells as an Optuna study that any number of workers drain, each cell exactly once.

``ablate --storage URL`` enqueues each cell that has no finished MLflow run (of this code)
as an Optuna trial with the user attribute ``cell`` (its index in ``Protocol.cells()``).
Workers (``workbench worker --storage URL``) pop waiting trials with ``study.ask()``.

Exactly once, with fencing. A worker holding a cell holds a *lease* on its trial (user
attribute ``lease``: host, pid, token, heartbeat time), renewed every ``heartbeat``
seconds. Any worker that finds a RUNNING trial whose lease is older than ``grace``
(or whose process is gone on this host) fails that trial and queues the cell again; this
works the same on RDB storage (PostgreSQL) and JournalStorage, so no manual step is needed.
The worker whose lease was taken over (it was paused, cut off, declared dead) finds its
trial no longer RUNNING at its next step and stops without writing anything more; the
MLflow run of the cell is fenced the same way by its lease token (``tracking.record.lease``).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import warnings

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from studies.runtime.study_protocol import Protocol, load_protocol
from tracking.record.lease import HOST, pid_alive
from tracking.store.storage_guard import refuse_mlflow_database

# Optuna's "experimental" warnings add nothing for users here.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def debugging() -> bool:
    """``workbench --debug`` (or WORKBENCH_DEBUG=1) is on for this command."""
    import click

    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().params.get("debug"):
        return True
    return os.environ.get("WORKBENCH_DEBUG", "").lower() in ("1", "true", "yes")


def quiet_optuna() -> None:
    """Optuna's INFO lines (``[I 2026-...] A new study created in Journal with name: ...``, ``Trial 3
    finished with value ...``) only with ``--debug``: the workbench says what happened in its own
    lines. Its warnings stay."""
    optuna.logging.set_verbosity(optuna.logging.INFO if debugging() else optuna.logging.WARNING)


quiet_optuna()

HEARTBEAT_SECONDS = 10
GRACE_SECONDS = 30
LEASE_ATTR = "lease"


def check_timing(heartbeat: float, grace: float) -> None:
    if heartbeat >= grace:
        raise ValueError(f"--heartbeat {heartbeat:g} must be shorter than --grace {grace:g}: otherwise every live "
                         "worker's cell would look abandoned between two heartbeats")


def open_storage(url: str, heartbeat: float = HEARTBEAT_SECONDS, grace: float = GRACE_SECONDS):
    """RDB storage (PostgreSQL, MySQL, SQLite URL) or a journal file (``journal:/path``).

    Optuna creates its tables here, so the target is looked into first, from whichever
    machine this runs on: one of MLflow's databases is refused (``StorageClash``, a
    ValueError naming it) and nothing is created.
    """
    check_timing(heartbeat, grace)
    quiet_optuna()  # a --debug given to this command, whose module was imported before it was parsed
    refuse_mlflow_database(url)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    # No Optuna heartbeats: the lease below does the same job on every storage, with fencing.
    return RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def redact(url: str) -> str:
    """A storage URL safe to print or log: the password replaced by ***."""
    if url.startswith("journal:"):
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def study_name_for(protocol: Protocol) -> str:
    return f"cells:{protocol.name}@{protocol.short_hash}"


def _completed_cells(study: optuna.Study) -> set[int]:
    return {t.user_attrs.get("cell") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}


def enqueue_cells(protocol: Protocol, protocol_file: Path, storage, parent_run_id: str, finished: set[tuple[str, int]],
                  settings: dict, order: list[int] | None = None) -> tuple[str, int]:
    """Put every cell without a finished run into the queue, once. Returns (study name, cells enqueued).

    ``order``: cell indices in the order workers should take them (default: protocol order).
    """
    name = study_name_for(protocol)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
    study.set_user_attr("protocol_file", str(protocol_file))
    study.set_user_attr("protocol_hash", protocol.hash)
    study.set_user_attr("parent_run_id", parent_run_id)
    study.set_user_attr("settings", settings)
    # A cell already waiting, running or done in the queue is not added again.
    queued = {t.user_attrs.get("cell") for t in study.get_trials(
        deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE))}
    added = 0
    cells = protocol.cells()
    for index in order if order is not None else range(len(cells)):
        cell = cells[index]
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


# ------------------------------------------------------------------ leases on trials


def new_lease() -> dict:
    return {"host": HOST, "pid": os.getpid(), "token": uuid.uuid4().hex[:16], "heartbeat": time.time()}


def renew(study: optuna.Study, trial_id: int, lease: dict) -> None:
    """Write a fresh heartbeat; raises once the trial is no longer RUNNING (it was taken over)."""
    study._storage.set_trial_user_attr(trial_id, LEASE_ATTR, {**lease, "heartbeat": time.time()})


def holds(study: optuna.Study, trial_id: int, lease: dict) -> str | None:
    """None while this lease still holds the trial, else one line saying why it does not."""
    trial = study._storage.get_trial(trial_id)
    if trial.state != TrialState.RUNNING:
        return f"the queue marked this cell {trial.state.name} (its lease expired and it was handed on)"
    token = trial.user_attrs.get(LEASE_ATTR, {}).get("token")
    if token != lease["token"]:
        return f"another worker holds this cell's lease now (token {token})"
    return None


def expired(trial: FrozenTrial, grace: float, now: float | None = None) -> str | None:
    """Why a RUNNING trial's lease is expired, or None while its holder is alive."""
    now = now or time.time()
    lease = trial.user_attrs.get(LEASE_ATTR)
    if lease is None:  # popped but never leased: the worker died right after popping
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        return f"no lease {now - started:.0f} s after it was popped" if now - started > grace else None
    age = now - float(lease["heartbeat"])
    if lease["host"] == HOST and not pid_alive(int(lease["pid"])):
        return f"worker {lease['host']}/{lease['pid']} is gone (last heartbeat {age:.0f} s ago)"
    if age > grace:
        return f"lease of worker {lease['host']}/{lease['pid']} expired: last heartbeat {age:.0f} s ago (grace {grace:g} s)"
    return None



def requeue_expired(study: optuna.Study, grace: float, log=print) -> int:
    """Fail every RUNNING trial whose lease expired and queue its cell again (unless it completed)."""
    n = 0
    done = _completed_cells(study)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        why = expired(trial, grace)
        if why is None:
            continue
        try:  # the owner may have finished or been failed by another worker meanwhile
            if not study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                continue
        except (RuntimeError, ValueError):
            continue
        cell = trial.user_attrs.get("cell")
        if cell in done:
            log(f"cell {cell}: {why}; already completed, not queued again")
            continue
        attrs = {k: v for k, v in trial.user_attrs.items() if k != LEASE_ATTR}
        study.enqueue_trial({"cell": cell}, user_attrs={**attrs, "retry_of": trial.number})
        log(f"re-queued cell {cell} ({attrs.get('arm')}/seed{attrs.get('seed')}): {why}")
        n += 1
    return n
