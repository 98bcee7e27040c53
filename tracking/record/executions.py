"""A study's executions on its parent run: their records, and the parent's counts, status and end.

The rules of the study record that do not depend on how a parent is found live here
(docs/study-record.md):

- Every execution writes ``executions/<start>-<host>-<pid>.json`` when it starts and again
  when it ends (outcome, end, counts, the status it left). An execution that died
  (SIGKILL, a lost machine) cannot: the next execution that finds its lease tag dead closes
  its record (``outcome: died: ...``, end = its last heartbeat).
- Counts come from the children in the store, one per cell (``counts_of``), logged at a
  step of the execution's own (``execution_step``).
- The parent's status follows from how the execution ended, the counts and whether another
  execution still holds the parent (``study_status``).
- The parent's end time is the end of the study's last work: an execution that ran nothing
  (every cell skipped) does not move it (``end_time_for``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric, Run
from mlflow.tracking import MlflowClient

from tracking.record.lease import execution_states
from tracking.record.lease_rule import HOST, pid_alive
from tracking.record.schema import (
    CELL,
    EXEC_PREFIX,
    HEARTBEAT_TAG,
    PARENT,
    PARENT_RUN_ID,
    RUN_KEY,
    SUPERSEDED_TAG,
    TRUE,
    all_of,
    tag_is,
)
from tracking.record.sink import RunSink, log_batch
from tracking.store.offline_store import fallback_uri
from tracking.store.redact import redact_argv
from tracking.store.session import run_user

RECORDS = "executions"
# the study's cell count, so a parent can be recounted anywhere (sync)
EXPECTED_TAG = "cells_expected"
COUNT_KEYS = ("finished", "running", "failed", "killed", "superseded", "missing")
# Executions after which cells not run yet may still be waiting in a queue, or were left for a
# later execution on purpose (``subset``: ``ablate --arms`` ran only some arms): not missing.
QUEUE_OUTCOMES = ("queued", "worker", "subset")


def work_line(work: dict) -> str:
    """What a worker execution did itself: ``trained 2 cells, 0 already finished, 0 failed, 0 lost to another worker``."""
    ran = work.get("ran", 0)
    line = (
        f"trained {ran} cell{'' if ran == 1 else 's'}, {work.get('skipped', 0)} already finished, "
        f"{work.get('failed', 0)} failed, {work.get('lost', 0)} lost to another worker"
    )
    return line + (f"; {work['stopped']}" if work.get("stopped") else "")


def iso(seconds: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))


def new_record(execution: str, git_commit: str) -> dict:
    """This execution's record as it starts (``execution``: its own lease token)."""
    return {
        "host": HOST,
        "pid": os.getpid(),
        "user": run_user(),
        "execution": execution,
        "start": iso(),
        "end": None,
        "outcome": "running",
        "argv": redact_argv(sys.argv[1:])[:500],
        "git_commit": git_commit,
    }


def record_name(record: dict) -> str:
    return f"{str(record['start']).replace(':', '')}-{record['host']}-{record['pid']}.json"


def write_record(sink: RunSink, record: dict) -> None:
    """The record on the parent (redacted by the sink); a record is not worth failing the study for."""
    with contextlib.suppress(Exception):
        sink.log_record(record, f"{RECORDS}/{record_name(record)}")


def execution_step(client: MlflowClient, run_id: str, record: dict) -> int:
    """The step at which this execution logs the parent's counts: one point per execution, never shared.

    Its place among the parent's execution records, by name (start, host, pid), counted
    from 1: executions one after another get 1, 2, 3 as before, and two that ran at once
    get a step each (before, both logged at the number of records, the same step). A step
    that already holds counts (a ``workbench sync`` recount, say) gives way to the next free one.
    """
    names = sorted(Path(info.path).name for info in client.list_artifacts(run_id, RECORDS))
    mine = record_name(record)
    step = 1 + (names.index(mine) if mine in names else len(names))
    taken = {m.step for m in client.get_metric_history(run_id, "cells_finished")}
    return step if step not in taken else 1 + max(taken)


def _open_records(client: MlflowClient, run_id: str) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for info in client.list_artifacts(run_id, RECORDS):
            with contextlib.suppress(Exception):
                record = json.loads(
                    Path(client.download_artifacts(run_id, info.path, tmp)).read_text()
                )
                if record.get("outcome") == "running":
                    records.append(record)
    return records


def close_dead_records(sink: RunSink, run: Run) -> list[str]:
    """Close the records of the parent's dead executions and drop their lease tags; returns the tags dropped.

    An execution is dead when its lease tag says so, or (a record left ``running`` without
    a tag, e.g. by an older workbench) when no execution holds the parent any more or its
    process is gone on this host.
    """
    # where its records are now
    client = MlflowClient(fallback_uri() if sink.mirror_id else sink.uri)
    states = execution_states(run)
    dead = {key: (state, beat) for key, (state, beat) in states.items() if not state.alive}
    alive = {key.removeprefix(EXEC_PREFIX) for key, (state, _) in states.items() if state.alive}
    if dead or run.info.status != "RUNNING" or not alive:
        for record in _open_records(client, sink.local_run_id):
            mine = dead.get(EXEC_PREFIX + str(record.get("execution")))
            if mine is None and (record.get("execution") in alive or not _gone(record, alive)):
                continue
            why, beat = (
                (mine[0].why, mine[1]) if mine else ("its execution is gone", _last_beat(run))
            )
            record.update(
                end=iso(beat) if beat else None,
                outcome=f"died: {why}"[:500],
                status=run.info.status,
                closed_by=f"{HOST} {os.getpid()}",
            )
            write_record(sink, record)
    for key in dead:  # killed executions never removed their own tag
        with contextlib.suppress(Exception):
            client.delete_tag(sink.local_run_id, key)
    return list(dead)


def _gone(record: dict, alive: set[str]) -> bool:
    if record.get("host") == HOST:
        return not pid_alive(int(record.get("pid") or 0))
    return not alive  # another host: gone once nobody renews the parent


def _last_beat(run: Run) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        return float(run.data.tags.get(HEARTBEAT_TAG))
    return None


def children(client: MlflowClient, parent_run_id: str, experiment_id: str) -> list[Run]:
    return client.search_runs(
        [experiment_id],
        all_of(tag_is(PARENT_RUN_ID, parent_run_id), tag_is(CELL, TRUE)),
        max_results=50000,
    )


def counts_of(runs: list[Run], expected: int) -> dict[str, int]:
    """Cell counts from the children as they are in the store, not one execution's view.

    One count per cell (run key): a cell continued in a new run because its old holder might
    still write (``superseded_by``) is counted by the run that carries it on, and the closed
    run only under ``superseded``; a cell with a FINISHED run is finished.
    """
    by_cell: dict[str, list[Run]] = {}
    for run in runs:
        by_cell.setdefault(run.data.tags.get(RUN_KEY) or run.info.run_id, []).append(run)
    counts = dict.fromkeys(COUNT_KEYS, 0)
    counts["superseded"] = sum(SUPERSEDED_TAG in run.data.tags for run in runs)
    for cell in by_cell.values():
        current = [r for r in cell if SUPERSEDED_TAG not in r.data.tags] or cell
        statuses = {r.info.status for r in current}
        status = (
            "FINISHED"
            if "FINISHED" in statuses
            else max(current, key=lambda r: r.info.start_time or 0).info.status
        )
        counts[status.lower()] = counts.get(status.lower(), 0) + 1
    counts["missing"] = max(0, expected - len(by_cell))
    return counts


def study_status(outcome: str, counts: dict[str, int], others_hold_it: bool = False) -> str:
    """The parent's status when an execution ends with ``outcome`` (completed, interrupted, failed,
    queued, or worker: a worker that took cells from the queue).

    Another execution still holding the parent, or cells still RUNNING -> RUNNING (the last
    one to end decides); Ctrl-C or SIGTERM -> KILLED; an error or a failed or killed cell ->
    FAILED; cells queued but not run yet -> SCHEDULED; everything finished -> FINISHED.
    """
    if others_hold_it or counts.get("running"):
        return "RUNNING"
    if outcome == "interrupted":
        return "KILLED"
    if outcome == "failed" or counts.get("failed") or counts.get("killed"):
        return "FAILED"
    if counts.get("missing"):
        return "SCHEDULED" if outcome in QUEUE_OUTCOMES else "FAILED"
    return "FINISHED"


def end_time_for(previous_end: int | None, started_ms: int, runs: list[Run]) -> int | None:
    """The parent's end (ms; None: now): kept when this execution saw no cell work since it started.

    A rerun that skips every cell must not stretch a 5-minute study to the time of the rerun.
    """
    worked = any(r.info.status == "RUNNING" or (r.info.end_time or 0) >= started_ms for r in runs)
    return None if worked or not previous_end else previous_end


def recount(client: MlflowClient, run: Run) -> dict[str, int] | None:
    """Counts of a study parent from its children in ``client``'s store (after a sync), or None if unknown.

    The expected cell count is the parent's ``cells_expected`` tag, else what its last
    counts add up to (parents logged before that tag existed).
    """
    tags, metrics = run.data.tags, run.data.metrics
    try:
        expected = int(tags[EXPECTED_TAG])
    except (KeyError, ValueError):
        parts = [metrics.get(f"cells_{k}") for k in COUNT_KEYS if k != "superseded"]
        if any(p is None for p in parts):
            return None
        expected = int(sum(parts))
    return counts_of(children(client, run.info.run_id, run.info.experiment_id), expected)


def recount_parent(client: MlflowClient, run_id: str, log=print) -> dict[str, int] | None:
    """Log a study parent's counts from its children in ``client``'s store, and correct its ended status.

    For ``workbench sync``: the counts a parent got in the local fallback store saw only the
    cells logged there. A parent still RUNNING (held) or KILLED (interrupted) keeps its status.
    """
    run = client.get_run(run_id)
    counts = recount(client, run) if run.data.tags.get(PARENT) == TRUE else None
    if counts is None:
        return None
    before = {k: run.data.metrics.get(f"cells_{k}") for k in COUNT_KEYS}
    if before != {k: float(v) for k, v in counts.items()}:
        step = 1 + max(
            (m.step for m in client.get_metric_history(run_id, "cells_finished")), default=-1
        )
        now = int(time.time() * 1000)
        log_batch(
            client,
            run_id,
            metrics=[Metric(f"cells_{k}", float(v), now, step) for k, v in counts.items()],
        )
        log(
            f"parent {run_id}: cells counted on the target: "
            + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        )
    outcome = run.data.tags.get("last_execution_outcome", "").split(":")[0]
    if run.info.status in ("FINISHED", "FAILED", "SCHEDULED") and outcome in (
        "completed",
        "failed",
        *QUEUE_OUTCOMES,
    ):
        status = study_status(outcome, counts)
        if status != run.info.status:
            client.set_terminated(run_id, status, end_time=run.info.end_time)
            log(f"parent {run_id}: {run.info.status} -> {status} (from its cells on the target)")
    return counts
