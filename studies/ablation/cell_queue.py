"""Protocol cells as an Optuna study that any number of workers drain, each cell exactly once.

``ablate --storage URL`` enqueues each cell that has no finished MLflow run (of this code)
as an Optuna trial with the user attribute ``cell`` (its index in ``Protocol.cells()``).
Workers (``workbench worker --storage URL``) pop waiting trials with ``study.ask()``.

The queue's record says who holds which cell and how it ended, for ``ablate --jobs`` too
(it reads its workers' cells from here, never from their console): a trial's user
attributes ``cell``, ``key``, ``arm``, ``seed`` (written when it is queued), ``lease`` (the
holder's host, pid, token and heartbeat, written right after ``ask``) and ``outcome``
(finished, skipped, failed or busy: written by the holder right before it tells the queue).
Trials are read and written through the public API of the storage this process opened
(``CellQueue``), never through Optuna's private attributes.

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
from pathlib import Path

import warnings

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from studies.runtime.study_protocol import Protocol, load_protocol
from tracking.record.lease_rule import Lease
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
# The queue's record, in each trial's user attributes (the module says what each holds).
CELL_ATTR, KEY_ATTR, LEASE_ATTR, OUTCOME_ATTR, RETRY_ATTR = (
    "cell",
    "key",
    "lease",
    "outcome",
    "retry_of",
)
HANDED_BACK_ATTR = "handed_back"  # on a trial queued again by its preempted holder: why


def check_timing(heartbeat: float, grace: float) -> None:
    if heartbeat >= grace:
        raise ValueError(
            f"--heartbeat {heartbeat:g} must be shorter than --grace {grace:g}: otherwise every live "
            "worker's cell would look abandoned between two heartbeats"
        )


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
    return RDBStorage(url, engine_kwargs=engine_kwargs(url))


def engine_kwargs(url: str) -> dict:
    """How the queue's engine connects to a database server: one connection per operation, closed when it ends.

    A worker touches the queue a few times a minute (a lease renewal every ``--heartbeat``,
    a poll every 2 s while it waits, a pop and a tell per cell) from two threads at most (the
    cell's and the heartbeat's). SQLAlchemy's default pool would keep the connections it once
    needed open for the worker's life; without a pool a worker holds at most 2, and none
    between operations, so PostgreSQL's ``max_connections`` bounds the workers inside an
    operation at once, not the workers alive (docs/remote.md, "Many workers"). psycopg's
    server-side prepared statements are turned off: behind pgbouncer in transaction pooling
    (before 1.21) the next statement may reach a server connection that never saw them.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    parsed = make_url(url)
    # SQLite is a file (or memory) on this machine: no server connections to spare, and an
    # in-memory database lives only as long as its connection.
    if parsed.get_backend_name() == "sqlite":
        return {"pool_pre_ping": True}
    kwargs: dict = {"poolclass": NullPool}
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
        kwargs["connect_args"] = {"prepare_threshold": None}
    return kwargs


def redact(url: str) -> str:
    """A storage URL safe to print or log: the password replaced by ***."""
    if url.startswith("journal:"):
        return url
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def study_name_for(protocol: Protocol) -> str:
    return f"cells:{protocol.name}@{protocol.short_hash}"


def _completed_cells(study: optuna.Study) -> set[int]:
    return {
        t.user_attrs.get(CELL_ATTR)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    }


class CellQueue:
    """A cell queue: its Optuna study and the storage this process opened it on.

    A trial is named by its public ``number``; its record is read and written through the
    storage's public methods (``BaseStorage``), so nothing here uses a private attribute
    of Optuna's study or trials.
    """

    def __init__(self, study: optuna.Study, storage) -> None:
        self.study, self.storage = study, storage
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self._ids: dict[int, int] = {}

    @classmethod
    def load(cls, name: str, storage) -> "CellQueue":
        return cls(optuna.load_study(study_name=name, storage=storage), storage)

    def trial_id(self, number: int) -> int:
        if number not in self._ids:
            self._ids[number] = self.storage.get_trial_id_from_study_id_trial_number(
                self.study_id, number
            )
        return self._ids[number]

    def trial(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self.trial_id(number))

    def trials(self, states=None) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states)

    def set_attr(self, number: int, key: str, value) -> None:
        """One user attribute of a trial; raises once the trial is finished (Optuna refuses the write)."""
        self.storage.set_trial_user_attr(self.trial_id(number), key, value)

    def fail(self, number: int) -> bool:
        """Mark a RUNNING trial FAIL; False when another process ended it first."""
        return self.storage.set_trial_state_values(self.trial_id(number), TrialState.FAIL)


def enqueue_cells(
    protocol: Protocol,
    protocol_file: Path,
    storage,
    parent_run_id: str,
    finished: set[tuple[str, int]],
    settings: dict,
    order: list[int] | None = None,
) -> tuple[str, int]:
    """Put every cell without a finished run into the queue, once. Returns (study name, cells enqueued).

    ``order``: cell indices in the order workers should take them (default: protocol order).
    """
    name = study_name_for(protocol)
    study = optuna.create_study(
        study_name=name, storage=storage, direction="maximize", load_if_exists=True
    )
    study.set_user_attr("protocol_file", str(protocol_file))
    study.set_user_attr("protocol_hash", protocol.hash)
    study.set_user_attr("parent_run_id", parent_run_id)
    study.set_user_attr("settings", settings)
    # A cell already waiting, running or done in the queue is not added again.
    queued = {
        t.user_attrs.get(CELL_ATTR)
        for t in study.get_trials(
            deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE)
        )
    }
    added = 0
    cells = protocol.cells()
    for index in order if order is not None else range(len(cells)):
        cell = cells[index]
        if (cell.arm, cell.seed) in finished or index in queued:
            continue
        study.enqueue_trial(
            {"cell": index},
            user_attrs={CELL_ATTR: index, KEY_ATTR: cell.key, "arm": cell.arm, "seed": cell.seed},
        )
        added += 1
    return name, added


def counts(queue: CellQueue) -> dict[str, int]:
    """Trials per state (``waiting``, ``running``, ``complete``, ``fail``, ``pruned``)."""
    trials = queue.trials()
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
# The rule is tracking.record.lease_rule's (one for MLflow runs and queue trials); this is its
# queue side: the lease lives in the trial's user attribute ``lease``, a takeover fails the
# trial and queues its cell again, and ``tell`` is the release.


def new_lease() -> dict:
    """A lease of this process on a trial, in the form the queue stores."""
    return Lease.mine().as_record()


def renew(queue: CellQueue, number: int, lease: dict, now: float | None = None) -> None:
    """Write a fresh heartbeat; raises once the trial is no longer RUNNING (it was taken over)."""
    queue.set_attr(number, LEASE_ATTR, Lease.from_record(lease).renewed(now).as_record())


def holds(queue: CellQueue, number: int, lease: dict) -> str | None:
    """None while this lease still holds the trial, else one line saying why it does not."""
    trial = queue.trial(number)
    if trial.state != TrialState.RUNNING:
        return f"the queue marked this cell {trial.state.name} (its lease expired and it was handed on)"
    found = Lease.from_record(trial.user_attrs.get(LEASE_ATTR))
    if found is None or found.token != lease["token"]:
        return (
            f"another worker holds this cell's lease now (token {found.token if found else None})"
        )
    return None


def expired(trial: FrozenTrial, grace: float, now: float | None = None) -> str | None:
    """Why a RUNNING trial's lease is expired, or None while its holder is alive."""
    now = time.time() if now is None else now
    lease = Lease.from_record(trial.user_attrs.get(LEASE_ATTR))
    if lease is None:  # popped but never leased: the worker died right after popping
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        return (
            f"no lease {now - started:.0f} s after it was popped" if now - started > grace else None
        )
    state = lease.state(grace, now, limit="grace")
    return None if state.alive else state.why


def requeue_expired(queue: CellQueue, grace: float, log=print, now: float | None = None) -> int:
    """Fail every RUNNING trial whose lease expired and queue its cell again (unless it completed)."""
    n = 0
    done = _completed_cells(queue.study)
    for trial in queue.trials(states=(TrialState.RUNNING,)):
        why = expired(trial, grace, now)
        if why is None:
            continue
        try:  # the owner may have finished or been failed by another worker meanwhile
            if not queue.fail(trial.number):
                continue
        except (RuntimeError, ValueError):
            continue
        cell = trial.user_attrs.get(CELL_ATTR)
        if cell in done:
            log(f"cell {cell}: {why}; already completed, not queued again")
            continue
        _queue_again(queue, trial)
        log(
            f"re-queued cell {cell} ({trial.user_attrs.get('arm')}/seed{trial.user_attrs.get('seed')}): {why}"
        )
        n += 1
    return n


def _queue_again(queue: CellQueue, trial: FrozenTrial, **extra) -> None:
    """A new waiting trial for a failed trial's cell, with its record (not its lease or outcome)."""
    attrs = {k: v for k, v in trial.user_attrs.items() if k not in (LEASE_ATTR, OUTCOME_ATTR)}
    queue.study.enqueue_trial(
        {"cell": trial.user_attrs.get(CELL_ATTR)},
        user_attrs={**attrs, RETRY_ATTR: trial.number, **extra},
    )


def hand_back(queue: CellQueue, number: int, lease: dict, why: str) -> bool:
    """Give a cell this worker holds back to the queue now: its trial failed and the cell queued again.

    What ``requeue_expired`` does for a dead holder once ``--grace`` has passed, done by the holder
    itself (a preempted worker), so the next worker takes the cell at once. False when the lease
    no longer holds the trial (another worker has the cell already: nothing to give back).
    """
    if holds(queue, number, lease) is not None:
        return False
    trial = queue.trial(number)
    try:
        if not queue.fail(number):
            return False
    except (RuntimeError, ValueError):  # ended by another process a moment before
        return False
    _queue_again(queue, trial, **{HANDED_BACK_ATTR: why[:300]})
    return True
