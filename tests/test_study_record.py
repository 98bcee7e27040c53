"""The study record after an outage and at its end: counts recounted after sync, the exit code agrees with the parent."""

from __future__ import annotations

import time

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from test_ablate_record import runs, study  # noqa: F401  (study: a fixture)


def test_sync_recounts_a_parent_from_its_children_on_the_target(mlflow_store, tmp_path):
    """Before: the server's parent kept the fallback store's `cells_finished=3 cells_missing=1` for 4 finished cells."""
    from tracking.record.sink import SYNC_SERVER_RUN
    from tracking.export.offline_sync import sync

    server = MlflowClient(mlflow_store)
    exp = server.create_experiment("rec")
    parent_tags = {
        "parent": "true",
        "cells_expected": "4",
        "last_execution_outcome": "completed",
        "mlflow.runName": "rec@x",
    }
    parent = server.create_run(exp, tags=parent_tags)
    for k in range(3):  # cells finished on the server before it went away
        cell = server.create_run(
            exp, tags={"cell": "true", "run_key": f"k{k}", "mlflow.parentRunId": parent.info.run_id}
        )
        server.set_terminated(cell.info.run_id, "FINISHED")
    local = MlflowClient(f"sqlite:///{tmp_path / 'fallback.db'}")
    local_exp = local.create_experiment("rec")
    mirror = local.create_run(local_exp, tags={**parent_tags, SYNC_SERVER_RUN: parent.info.run_id})
    stamp = int(time.time() * 1000)
    local.log_batch(
        mirror.info.run_id,
        metrics=[
            Metric("cells_finished", 3, stamp, 0),
            Metric("cells_running", 0, stamp, 0),
            Metric("cells_failed", 0, stamp, 0),
            Metric("cells_killed", 0, stamp, 0),
            Metric("cells_missing", 1, stamp, 0),
        ],
    )
    local.set_terminated(mirror.info.run_id, "FAILED")  # what the execution counted offline
    last = local.create_run(
        local_exp, tags={"cell": "true", "run_key": "k3", "mlflow.parentRunId": parent.info.run_id}
    )
    local.log_batch(last.info.run_id, tags=[RunTag("mlflow.runName", "vit-seed3")])
    local.set_terminated(last.info.run_id, "FINISHED")
    lines = []
    report = sync(f"sqlite:///{tmp_path / 'fallback.db'}", mlflow_store, log=lines.append)
    assert report.errors == [], report.errors
    now = server.get_run(parent.info.run_id)
    counts = {
        k.removeprefix("cells_"): v for k, v in now.data.metrics.items() if k.startswith("cells_")
    }
    assert counts == {
        "finished": 4,
        "running": 0,
        "failed": 0,
        "killed": 0,
        "superseded": 0,
        "missing": 0,
    }, counts
    assert now.info.status == "FINISHED", lines


def test_ablate_exits_non_zero_when_the_parent_ended_failed(study, monkeypatch, tmp_path):  # noqa: F811
    """Before: `parent run ...: FAILED` and exit 0 (here: a cell that never got a run, so the study is incomplete)."""
    from click.testing import CliRunner

    from studies.ablation import ablate
    from studies.cli import main

    real = ablate.run_cell

    def seed1_never_runs(protocol, cell, *args, **kwargs):
        if cell.seed == 1:
            return ablate.CellOutcome(cell, "busy", f"{cell.key}: running elsewhere (stand-in)")
        return real(protocol, cell, *args, **kwargs)

    monkeypatch.setattr(ablate, "run_cell", seed1_never_runs)
    result = CliRunner().invoke(
        main,
        [
            "ablate",
            "--protocol",
            str(tmp_path / "rec.yaml"),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(tmp_path / "images"),
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    (parent,) = runs(MlflowClient(), "parent")
    assert parent.info.status == "FAILED"
    assert result.exit_code == 1, result.output
    assert (
        f"parent run {parent.info.run_id} ended FAILED (cells: 1 finished, 1 missing)"
        in result.output
    )


def test_a_run_continued_in_place_logs_only_the_metrics_it_lacks(mlflow_store):
    """A cell whose execution died after logging its results is continued in place: the numbers it
    holds are not logged again (before, every attribution metric got a second entry)."""
    from tracking.record.sink import RunSink

    client = MlflowClient()
    run = client.create_run(client.create_experiment("lacking"))
    RunSink.attach(run, mlflow_store, "lacking").log_metrics({"rho/chefer": 0.25, "images": 6})
    # the next execution: a new sink attached to the run, which already holds both keys at step 0
    again = RunSink.attach(client.get_run(run.info.run_id), mlflow_store, "lacking")
    again.log_lacking_metrics({"rho/chefer": 0.25, "images": 6, "patches": 4})
    again.log_lacking_metrics({"deletion_curve/chefer": 0.5}, step=2)
    again.log_lacking_metrics({"deletion_curve/chefer": 0.5}, step=2)
    again.log_lacking_metrics({"deletion_curve/chefer": 0.4}, step=3)
    history = {
        key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        for key in ("rho/chefer", "images", "patches", "deletion_curve/chefer")
    }
    assert history == {
        "rho/chefer": [0],
        "images": [0],
        "patches": [0],
        "deletion_curve/chefer": [2, 3],
    }, history
