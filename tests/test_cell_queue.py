"""The cell queue's leases: only expired leases are re-queued, finished cells never, a taken-over worker is fenced."""

from __future__ import annotations

import subprocess
import sys
import time

import optuna
import pytest
from click.testing import CliRunner
from optuna.trial import TrialState

from studies.ablation.cell_queue import (
    HANDED_BACK_ATTR,
    LEASE_ATTR,
    RETRY_ATTR,
    CellQueue,
    hand_back,
    holds,
    new_lease,
    open_storage,
    renew,
    requeue_expired,
)
from studies.ablation.worker import QueueFence
from studies.cli import main
from tracking.record.lease import LeaseLost


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def study(tmp_path):
    storage = open_storage(f"journal:{tmp_path / 'queue.log'}", heartbeat=1, grace=5)
    study = optuna.create_study(study_name="cells:t@0", storage=storage, direction="maximize")
    for cell in range(4):
        study.enqueue_trial(
            {"cell": cell},
            user_attrs={"cell": cell, "key": f"vit/seed{cell}", "arm": "vit", "seed": cell},
        )
    return CellQueue(study, storage)


def test_only_expired_leases_are_requeued_and_finished_cells_never(study):
    queue, study = study, study.study
    live, dead, stale, done = (study.ask() for _ in range(4))
    renew(queue, live.number, new_lease())  # this process: alive, fresh heartbeat
    renew(queue, dead.number, {**new_lease(), "pid": dead_pid()})  # its process is gone
    renew(queue, stale.number, {**new_lease(), "host": "elsewhere"})
    queue.set_attr(
        stale.number,
        LEASE_ATTR,
        {**new_lease(), "host": "elsewhere", "heartbeat": time.time() - 60},
    )
    study.tell(done, 1.0)
    lines = []
    assert requeue_expired(queue, grace=5, log=lines.append) == 2
    assert (
        len(lines) == 2 and "is gone" in lines[0] and "expired: last heartbeat 60 s ago" in lines[1]
    ), lines
    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states[live.number] == TrialState.RUNNING and states[done.number] == TrialState.COMPLETE
    assert states[dead.number] == states[stale.number] == TrialState.FAIL
    waiting = sorted(
        t.user_attrs["cell"] for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    )
    assert waiting == sorted([dead.user_attrs["cell"], stale.user_attrs["cell"]])
    assert requeue_expired(queue, grace=5, log=lines.append) == 0  # nothing twice


def test_a_worker_whose_lease_was_taken_over_stops_at_its_next_step(study):
    queue = study
    trial = queue.study.ask()
    lease = {**new_lease(), "host": "paused-vm"}
    renew(queue, trial.number, lease)
    fence = QueueFence(queue, trial.number, lease)
    fence.check(sync=True)  # still ours
    queue.set_attr(trial.number, LEASE_ATTR, {**lease, "heartbeat": time.time() - 60})
    assert requeue_expired(queue, grace=5, log=lambda _: None) == 1
    fence.beat()  # the paused worker's next heartbeat is refused: the trial is FAIL now
    with pytest.raises(LeaseLost, match="marked this cell FAIL"):
        fence.check()
    assert holds(queue, trial.number, lease).startswith("the queue marked this cell FAIL")


def test_a_preempted_worker_hands_its_cell_back_at_once_and_only_a_cell_it_holds(study):
    """Given back by its live holder: queued again now, no --grace waited; a lease that no longer
    holds the trial gives nothing back (another worker has the cell)."""
    queue = study
    mine, other = queue.study.ask(), queue.study.ask()
    lease = new_lease()  # this process: alive, fresh heartbeat, so nothing would expire it
    renew(queue, mine.number, lease)
    renew(queue, other.number, new_lease())
    assert requeue_expired(queue, grace=5, log=lambda _: None) == 0
    assert hand_back(queue, mine.number, lease, "preempted (signal SIGTERM)")
    trials = {t.number: t for t in queue.study.get_trials(deepcopy=False)}
    assert trials[mine.number].state == TrialState.FAIL
    (again,) = [t for t in trials.values() if t.user_attrs.get(RETRY_ATTR) == mine.number]
    assert again.state == TrialState.WAITING and again.user_attrs["cell"] == mine.user_attrs["cell"]
    assert again.user_attrs[HANDED_BACK_ATTR] == "preempted (signal SIGTERM)"
    assert LEASE_ATTR not in again.user_attrs
    # Twice, or with a lease that is not the trial's: nothing more is queued.
    assert not hand_back(queue, mine.number, lease, "again")
    assert not hand_back(queue, other.number, new_lease(), "not mine")
    assert trials[other.number].state == TrialState.RUNNING
    assert len(queue.study.get_trials(deepcopy=False)) == len(trials)


def test_a_heartbeat_not_shorter_than_the_grace_period_is_refused(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "worker",
            "--storage",
            f"journal:{tmp_path / 'q.log'}",
            "--heartbeat",
            "60",
            "--grace",
            "5",
        ],
    )
    assert (
        result.exit_code == 2 and "--heartbeat 60 must be shorter than --grace 5" in result.output
    ), result.output
    assert "Traceback" not in result.output


def test_optunas_info_lines_are_off_the_console_unless_debugging(monkeypatch):
    import logging

    import optuna

    from studies.ablation.cell_queue import quiet_optuna

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("optuna").addHandler(handler)  # beside Optuna's own console handler
    try:
        monkeypatch.delenv("WORKBENCH_DEBUG", raising=False)
        quiet_optuna()
        optuna.create_study(study_name="quiet")
        assert said == [], said
        monkeypatch.setenv("WORKBENCH_DEBUG", "1")
        quiet_optuna()
        optuna.create_study(study_name="told")
        assert said == ["A new study created in memory with name: told"], said
    finally:
        logging.getLogger("optuna").removeHandler(handler)
        monkeypatch.delenv("WORKBENCH_DEBUG", raising=False)
        quiet_optuna()
