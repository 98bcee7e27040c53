"""History, not stale state: closed execution records, no stale reasons, a true end time, counts recounted after sync."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

import workbench.train.loop as loop_mod
from test_ablate_record import dead_pid, runs, study  # noqa: F401  (study: a fixture)
from tracking.executions import iso
from tracking.lease import EXEC_PREFIX, HEARTBEAT_TAG, HOST_TAG, PID_TAG, REASON_TAG, TOKEN_TAG
from tracking.sink import HISTORY_TAG, OUTCOME_TAGS

import pytest


def records(client: MlflowClient, run_id: str) -> list[dict]:
    return [json.loads(Path(client.download_artifacts(run_id, a.path)).read_text())
            for a in client.list_artifacts(run_id, "executions")]


def test_a_dead_executions_record_is_closed_and_no_reason_outlives_a_finished_run(study, tmp_path):  # noqa: F811
    """Before: its record said `outcome: running` forever; the FINISHED parent kept the reaper's killed_reason."""
    _, run = study
    client = MlflowClient()
    run()
    (parent,) = runs(client, "parent")
    # As a SIGKILLed execution leaves the parent: RUNNING, its own lease tag (process gone), its record open.
    pid, beat = dead_pid(), time.time() - 30
    client.update_run(parent.info.run_id, status="RUNNING")
    for k, v in {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), TOKEN_TAG: "shared", HEARTBEAT_TAG: f"{beat:.3f}",
                 EXEC_PREFIX + "gone": f"{socket.gethostname()} {pid} {beat:.3f}"}.items():
        client.set_tag(parent.info.run_id, k, v)
    record = {"host": socket.gethostname(), "pid": pid, "execution": "gone", "start": iso(beat - 60), "end": None,
              "outcome": "running", "argv": "ablate"}
    path = tmp_path / f"{record['start'].replace(':', '')}-{record['host']}-{pid}.json"
    path.write_text(json.dumps(record))
    client.log_artifact(parent.info.run_id, str(path), "executions")
    run()  # reaps the parent (KILLED, killed_reason), reattaches it, skips both cells
    now = client.get_run(parent.info.run_id)
    closed = [r for r in records(client, parent.info.run_id) if r["pid"] == pid]
    assert len(closed) == 1 and closed[0]["outcome"].startswith(f"died: process {pid} on"), closed
    assert closed[0]["end"] == iso(beat) and closed[0]["status"] == "KILLED", closed
    assert all(r["outcome"] != "running" and r["end"] for r in records(client, parent.info.run_id))
    assert now.info.status == "FINISHED"
    assert not [k for k in now.data.tags if k in OUTCOME_TAGS or k.startswith(EXEC_PREFIX)], now.data.tags
    assert "KILLED" in now.data.tags[HISTORY_TAG] and "is gone" in now.data.tags[HISTORY_TAG]


def test_a_cell_interrupted_then_finished_keeps_its_end_reason_only_as_history(study, monkeypatch):  # noqa: F811
    _, run = study
    client = MlflowClient()
    real = loop_mod.Trainer._end_epoch

    def interrupted(self, pos):
        real(self, pos)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod.Trainer, "_end_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run()
    (cell,) = runs(client, "cell")
    assert cell.info.status == "KILLED" and "KeyboardInterrupt" in cell.data.tags["end_reason"]
    monkeypatch.setattr(loop_mod.Trainer, "_end_epoch", real)
    run()
    now = client.get_run(cell.info.run_id)
    assert now.info.status == "FINISHED"
    assert not [k for k in now.data.tags if k in OUTCOME_TAGS], now.data.tags
    assert now.data.tags[HISTORY_TAG].startswith("KILLED (ended ") and "end_reason=KeyboardInterrupt" in \
        now.data.tags[HISTORY_TAG]


def test_sync_recounts_a_parent_from_its_children_on_the_target(mlflow_store, tmp_path):
    """Before: the server's parent kept the fallback store's `cells_finished=3 cells_missing=1` for 4 finished cells."""
    from tracking.sink import SYNC_SERVER_RUN
    from tracking.sync import sync

    server = MlflowClient(mlflow_store)
    exp = server.create_experiment("rec")
    parent_tags = {"parent": "true", "cells_expected": "4", "last_execution_outcome": "completed",
                   "mlflow.runName": "rec@x"}
    parent = server.create_run(exp, tags=parent_tags)
    for k in range(3):  # cells finished on the server before it went away
        cell = server.create_run(exp, tags={"cell": "true", "run_key": f"k{k}", "mlflow.parentRunId": parent.info.run_id})
        server.set_terminated(cell.info.run_id, "FINISHED")
    local = MlflowClient(f"sqlite:///{tmp_path / 'fallback.db'}")
    local_exp = local.create_experiment("rec")
    mirror = local.create_run(local_exp, tags={**parent_tags, SYNC_SERVER_RUN: parent.info.run_id})
    stamp = int(time.time() * 1000)
    local.log_batch(mirror.info.run_id, metrics=[Metric("cells_finished", 3, stamp, 0), Metric("cells_running", 0, stamp, 0),
                                                 Metric("cells_failed", 0, stamp, 0), Metric("cells_killed", 0, stamp, 0),
                                                 Metric("cells_missing", 1, stamp, 0)])
    local.set_terminated(mirror.info.run_id, "FAILED")  # what the execution counted offline
    last = local.create_run(local_exp, tags={"cell": "true", "run_key": "k3", "mlflow.parentRunId": parent.info.run_id})
    local.log_batch(last.info.run_id, tags=[RunTag("mlflow.runName", "vit-seed3")])
    local.set_terminated(last.info.run_id, "FINISHED")
    lines = []
    report = sync(f"sqlite:///{tmp_path / 'fallback.db'}", mlflow_store, log=lines.append)
    assert report.errors == [], report.errors
    now = server.get_run(parent.info.run_id)
    counts = {k.removeprefix("cells_"): v for k, v in now.data.metrics.items() if k.startswith("cells_")}
    assert counts == {"finished": 4, "running": 0, "failed": 0, "killed": 0, "superseded": 0, "missing": 0}, counts
    assert now.info.status == "FINISHED", lines


def test_ablate_exits_non_zero_when_the_parent_ended_failed(study, monkeypatch, tmp_path):  # noqa: F811
    """Before: `parent run ...: FAILED` and exit 0 (here: a cell that never got a run, so the study is incomplete)."""
    from click.testing import CliRunner

    import studies.ablate as ablate_mod
    from studies.cli import main

    real = ablate_mod.run_cell

    def seed1_never_runs(protocol, cell, *args, **kwargs):
        if cell.seed == 1:
            return ablate_mod.CellOutcome(cell, "busy", f"{cell.key}: running elsewhere (stand-in)")
        return real(protocol, cell, *args, **kwargs)

    monkeypatch.setattr(ablate_mod, "run_cell", seed1_never_runs)
    result = CliRunner().invoke(main, ["ablate", "--protocol", str(tmp_path / "rec.yaml"), "--allow-dirty", "--device",
                                       "cpu", "--data-path", str(tmp_path / "images"), "--output-dir",
                                       str(tmp_path / "out")])
    (parent,) = runs(MlflowClient(), "parent")
    assert parent.info.status == "FAILED"
    assert result.exit_code == 1, result.output
    assert f"parent run {parent.info.run_id} ended FAILED (cells: 1 finished, 1 missing)" in result.output
