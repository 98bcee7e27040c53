"""`ablate --jobs` learns which cell each worker holds, and how it ended, from the queue's record alone."""

from __future__ import annotations

import contextlib
import os
import signal

import optuna
import pytest

from studies.ablation.cell_queue import (
    KEY_ATTR,
    LEASE_ATTR,
    OUTCOME_ATTR,
    CellQueue,
    new_lease,
    open_storage,
    renew,
)
from studies.ablation.jobs import JobPool, outcomes
from studies.ablation.worker import drain


@pytest.fixture
def queue(tmp_path):
    storage = open_storage(f"journal:{tmp_path / 'queue.log'}", heartbeat=1, grace=5)
    study = optuna.create_study(study_name="cells:t@0", storage=storage, direction="maximize")
    for cell in range(2):
        study.enqueue_trial(
            {"cell": cell},
            user_attrs={"cell": cell, KEY_ATTR: f"vit/seed{cell}", "arm": "vit", "seed": cell},
        )
    return CellQueue(study, storage)


@pytest.fixture
def pool(queue):
    # A "worker" that prints nothing at all: whatever the pool knows of it comes from the queue.
    pool = JobPool(queue, ["sleep", "30"], dict(os.environ), most=2)
    yield pool
    for job in pool.jobs:
        with contextlib.suppress(ProcessLookupError):
            job.process.kill()
        job.process.wait()


def test_jobs_read_the_cell_a_silent_worker_holds_and_name_it_when_the_worker_dies(
    queue, pool, capsys
):
    job = pool.launch()
    pool.watch()
    assert job.current == "" and job.held is None
    trial = queue.study.ask()  # as the worker does: pop, then a lease naming its process
    renew(queue, trial.number, {**new_lease(), "pid": job.process.pid})
    pool.watch()
    assert (job.current, job.held) == ("vit/seed0", trial.number), (job.current, job.held)

    job.process.send_signal(signal.SIGKILL)
    job.process.wait()
    pool.replace_the_dead()
    said = capsys.readouterr().out
    assert (
        "[job 1] died (killed by SIGKILL) on cell vit/seed0; started job 2 in its place (its cell goes back to "
        "the queue, 2 cell(s) waiting or running)" in said
    ), said
    assert pool.tally == {"died": 1, "replaced": 1} and len(pool.jobs) == 2


def test_a_cell_the_worker_ended_is_held_by_nobody_and_its_outcome_counts(queue, pool):
    job = pool.launch()
    trial = queue.study.ask()
    renew(queue, trial.number, {**new_lease(), "pid": job.process.pid})
    pool.watch()
    assert job.current == "vit/seed0"
    # the worker's record of the end, before it tells
    queue.set_attr(trial.number, OUTCOME_ATTR, "skipped")
    pool.watch()
    assert (job.current, job.held) == ("", None)
    queue.study.tell(trial, 1.0)
    assert outcomes(queue.trials()) == {
        "finished": 0,
        "skipped": 1,
        "failed": 0,
        "busy": 0,
        "unfinished": 1,
    }


def test_a_worker_writes_its_lease_and_every_outcome_into_the_queue_and_prints_nothing(queue):
    seen, said = [], []

    def run_one(trial, fence):
        attrs = queue.trial(trial.number).user_attrs  # while it runs: the lease names this process
        seen.append((attrs[KEY_ATTR], attrs[LEASE_ATTR]["pid"], OUTCOME_ATTR in attrs))
        return ("finished", 0.5) if trial.user_attrs["cell"] == 0 else ("failed", float("nan"))

    tally = drain(queue, run_one, grace=5, poll_seconds=0.01, log=said.append)
    assert said == [] and tally == {"ran": 1, "skipped": 0, "failed": 1, "lost": 0}, (said, tally)
    assert seen == [("vit/seed0", os.getpid(), False), ("vit/seed1", os.getpid(), False)], seen
    assert {t.user_attrs[KEY_ATTR]: t.user_attrs[OUTCOME_ATTR] for t in queue.trials()} == {
        "vit/seed0": "finished",
        "vit/seed1": "failed",
    }
    assert outcomes(queue.trials()) == {
        "finished": 1,
        "skipped": 0,
        "failed": 1,
        "busy": 0,
        "unfinished": 0,
    }
