"""The MLflow record of a study stays clean: one parent, leases, truthful statuses, summaries once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from workbench.train import loop
from data_fixtures import make_image_folder
from studies.ablation.ablate import open_protocol, run_protocol
from studies.runtime.options import StudyOptions
from studies.cli import main
from tracking.record.executions import iso
from tracking.record.lease import (
    EXEC_PREFIX,
    HEARTBEAT_TAG,
    HOST_TAG,
    PID_TAG,
    REASON_TAG,
    TOKEN_TAG,
)
from tracking.record.sink import HISTORY_TAG, OUTCOME_TAGS
from workbench.train.fingerprint import current_code_fingerprint

PROTOCOL = """\
name: {name}
description: one-arm protocol for record tests
dataset: {{name: image_folder, val_size: 6, split_seed: 3}}
model: {{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}}
optim: {{lr: 0.003}}
run: {{epochs: {epochs}, batch_size: 8, checkpoint_every_steps: 2, evaluate_test: true}}
arms:
  - {{name: vit, reference: true}}
seeds: {seeds}
"""


@pytest.fixture
def study(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "rec.yaml"
    path.write_text(PROTOCOL.format(name="rec", epochs=2, seeds="[0, 1]"))
    protocol = open_protocol(str(path), allow_dirty=True)

    def run():
        return run_protocol(
            protocol,
            path,
            StudyOptions(
                output_dir=tmp_path / "out", device="cpu", data_path=str(folder), allow_dirty=True
            ),
        )

    return protocol, run


def protocol_file(protocol) -> Path:
    return Path.cwd() / "rec.yaml"


def runs(client: MlflowClient, what: str, experiment: str = "rec"):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], f"tags.{what} = 'true'")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def assert_clean(client: MlflowClient, experiment: str, cells: int) -> None:
    """One parent, nothing RUNNING, one run per cell, no metric step twice, no half-made model."""
    parents, children = runs(client, "parent", experiment), runs(client, "cell", experiment)
    assert len(parents) == 1, [p.info.run_id for p in parents]
    assert len(children) == cells and len({r.data.tags["run_key"] for r in children}) == cells
    assert all(r.info.status != "RUNNING" for r in parents + children)
    for r in children:
        assert r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        for key in r.data.metrics:
            steps = Counter(m.step for m in client.get_metric_history(r.info.run_id, key))
            assert max(steps.values()) == 1, (
                f"{r.data.tags['mlflow.runName']} {key}: steps {dict(steps)}"
            )
        models = client.search_logged_models(
            [r.info.experiment_id], filter_string=f"source_run_id = '{r.info.run_id}'"
        )
        assert [str(m.status).split(".")[-1] for m in models] == ["READY"], models


def test_every_execution_reattaches_the_one_parent_and_records_itself(study, monkeypatch, tmp_path):
    protocol, run = study
    client = MlflowClient()
    # `ablate --storage postgresql://mlflow:PW@host/optuna` (the runbook's own form): before, the password was
    # in every executions/*.json, readable by any READ user.
    monkeypatch.setattr(sys, "argv", SECRET_ARGV)
    monkeypatch.setenv("WORKBENCH_USER", "alice")
    assert [o.status for o in run()] == ["finished", "finished"]
    (first,) = runs(client, "parent")
    # another account reattaches it (a worker): not its creator
    monkeypatch.setenv("WORKBENCH_USER", "colab")
    assert [o.status for o in run()] == ["skipped", "skipped"]
    (parent,) = runs(client, "parent")
    assert parent.info.status == "FINISHED"
    # A rerun that ran nothing does not stretch the study's span (before: its end moved to the rerun's end).
    assert parent.info.end_time == first.info.end_time, (
        parent.info.end_time - first.info.end_time,
        "ms later",
    )
    tags = parent.data.tags
    assert tags["code_fingerprint"] == current_code_fingerprint() and tags["mlflow.user"] == "alice"
    assert (
        protocol.description in tags["mlflow.note.content"]
        and "| seeds | 0, 1 |" in tags["mlflow.note.content"]
    )
    records = [
        json.loads(Path(client.download_artifacts(parent.info.run_id, a.path)).read_text())
        for a in client.list_artifacts(parent.info.run_id, "executions")
    ]
    assert len(records) == 2 and {r["outcome"] for r in records} == {"completed"}
    assert all(r["host"] and r["pid"] and r["end"] and r["status"] == "FINISHED" for r in records)
    # Who ran each execution: the account (here WORKBENCH_USER), as on the runs it created.
    assert sorted(r["user"] for r in records) == ["alice", "colab"], records
    for record in records:  # the command line is there, minus its secrets
        assert (
            "--storage postgresql://***@db.example/optuna --password '***' --api-token=***"
            in record["argv"]
        ), record
    assert_no_secret(client, [parent, *runs(client, "cell")], tmp_path / "download")
    # counts come from the children, also in an execution that only skipped
    assert parent.data.metrics["cells_finished"] == 2 and parent.data.metrics["cells_missing"] == 0
    exp = client.get_experiment_by_name("rec")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    for cell in runs(client, "cell"):
        assert cell.data.params["arm"] == "vit" == cell.data.tags["arm"]
        assert cell.data.params["seed"] == cell.data.tags["seed"]
        assert cell.data.params["code_fingerprint"] == current_code_fingerprint()
        # per-epoch curves at steps 1..n; summary values under keys of their own at the last step, none at 0
        assert [m.step for m in client.get_metric_history(cell.info.run_id, "best_epoch")] == [1, 2]
        assert [
            m.step for m in client.get_metric_history(cell.info.run_id, "best_val_accuracy")
        ] == [2]
        assert [m.step for m in client.get_metric_history(cell.info.run_id, "test_accuracy")] == [2]
    assert_clean(client, "rec", 2)


def open_record(client: MlflowClient, parent_id: str, pid: int, folder: Path) -> dict:
    """What a SIGKILLed execution leaves on a parent: its lease tag (process gone) and its record, still open."""
    beat, host = time.time() - 30, socket.gethostname()
    client.set_tag(parent_id, EXEC_PREFIX + "gone", f"{host} {pid} {beat:.3f}")
    record = {
        "host": host,
        "pid": pid,
        "execution": "gone",
        "start": iso(beat - 60),
        "end": None,
        "outcome": "running",
        "argv": "ablate",
    }
    path = folder / f"{record['start'].replace(':', '')}-{host}-{pid}.json"
    path.write_text(json.dumps(record))
    client.log_artifact(parent_id, str(path), "executions")
    return {"pid": pid, "beat": beat}


def execution_records(client: MlflowClient, run_id: str) -> list[dict]:
    return [
        json.loads(Path(client.download_artifacts(run_id, a.path)).read_text())
        for a in client.list_artifacts(run_id, "executions")
    ]


def test_a_dead_executions_runs_are_killed_and_its_cell_resumes_under_the_one_parent(
    study, monkeypatch, capsys, tmp_path
):
    protocol, run = study
    client = MlflowClient()
    run()
    (parent,) = runs(client, "parent")
    cell = sorted(runs(client, "cell"), key=lambda r: r.data.tags["seed"])[1]
    # As a SIGKILLed execution leaves it: RUNNING, lease of a process that is gone, under another parent,
    # its summary half logged (no artifacts tag, a PENDING model beside the real one).
    stray = client.create_run(
        parent.info.experiment_id,
        tags={"parent": "true", "protocol_hash": protocol.hash, "protocol_name": "rec"},
    )
    lease = {
        HOST_TAG: __import__("socket").gethostname(),
        PID_TAG: str(dead_pid()),
        TOKEN_TAG: "old",
        HEARTBEAT_TAG: "0",
    }
    for run_id in (cell.info.run_id, parent.info.run_id, stray.info.run_id):
        client.update_run(run_id, status="RUNNING")
        for k, v in lease.items():
            client.set_tag(run_id, k, v)
    client.set_tag(cell.info.run_id, "mlflow.parentRunId", stray.info.run_id)
    client.delete_tag(cell.info.run_id, "summary.artifacts")
    client.create_logged_model(
        cell.info.experiment_id, name="model", source_run_id=cell.info.run_id
    )
    # ... and its own lease tag on the parent and its record, still open (it never wrote its end).
    dead = open_record(client, parent.info.run_id, int(lease[PID_TAG]), tmp_path)
    shown = CliRunner().invoke(main, ["status", "--protocol", str(protocol_file(protocol))])
    assert shown.exit_code == 0, shown.output
    assert (
        f"marked run {stray.info.run_id}" in shown.output
        and f"parent run {parent.info.run_id}: KILLED" in shown.output
    )
    # a killed cell with a checkpoint says where it resumes from (docs/remote.md, "Preemption")
    assert "vit/seed1: stale, marked KILLED, resumable from epoch" in shown.output, shown.output
    assert f"(run {cell.info.run_id}: process" in shown.output, shown.output
    assert f"-> next ablate: resume it in run {cell.info.run_id}" in shown.output
    assert (
        "vit/seed0: finished (run" in shown.output
        and "next ablate: skip it x1, resume it in run" in shown.output
    )
    monkeypatch.setattr(
        loop.Trainer, "_summarize", lambda self, pos: pytest.fail("summary computed twice")
    )
    capsys.readouterr()
    outcomes = run()
    out = capsys.readouterr()
    text = out.out + out.err
    assert [o.status for o in outcomes] == ["skipped", "finished"], [o.message for o in outcomes]
    assert "vit-seed0: skipped (finished in run" in text
    assert (
        f"vit-seed1: training had ended; completing its summary in run {cell.info.run_id}" in text
    )
    stray_now = client.get_run(stray.info.run_id)
    assert stray_now.info.status == "KILLED" and "is gone" in stray_now.data.tags[REASON_TAG]
    # the test's stand-in for an older parent; not part of the study now
    client.delete_run(stray.info.run_id)
    assert client.get_run(cell.info.run_id).data.tags["previous_parent_run_id"] == stray.info.run_id
    assert_clean(client, "rec", 2)
    # Its record is closed by this execution (before: `outcome: running` forever), and the FINISHED parent
    # keeps the reaper's killed_reason only as history (before: as its current state).
    records = execution_records(client, parent.info.run_id)
    (closed,) = [r for r in records if r["pid"] == dead["pid"]]
    assert (
        closed["outcome"].startswith(f"died: process {dead['pid']} on")
        and closed["status"] == "KILLED"
    ), closed
    assert closed["end"] == iso(dead["beat"]) and all(
        r["outcome"] != "running" and r["end"] for r in records
    )
    now = client.get_run(parent.info.run_id)
    assert now.info.status == "FINISHED"
    assert not [k for k in now.data.tags if k in OUTCOME_TAGS or k.startswith(EXEC_PREFIX)], (
        now.data.tags
    )
    assert (
        now.data.tags[HISTORY_TAG].startswith("KILLED (ended ")
        and "is gone" in now.data.tags[HISTORY_TAG]
    )


def test_ctrl_c_ends_the_parent_and_the_cell_killed_and_the_rerun_finishes(study, monkeypatch):
    _, run = study
    client = MlflowClient()
    real = loop.Trainer._end_epoch

    def interrupted(self, pos):
        real(self, pos)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop.Trainer, "_end_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run()
    (parent,) = runs(client, "parent")
    assert parent.info.status == "KILLED"
    (cell,) = runs(client, "cell")
    assert cell.info.status == "KILLED" and "KeyboardInterrupt" in cell.data.tags["end_reason"]
    monkeypatch.setattr(loop.Trainer, "_end_epoch", real)
    assert [o.status for o in run()] == ["finished", "finished"]
    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    assert_clean(client, "rec", 2)
    # The finished cell keeps how its first attempt ended only as history (before: a current end_reason).
    tags = client.get_run(cell.info.run_id).data.tags
    assert not [k for k in tags if k in OUTCOME_TAGS], tags
    assert (
        tags[HISTORY_TAG].startswith("KILLED (ended ")
        and "end_reason=KeyboardInterrupt" in tags[HISTORY_TAG]
    )


def test_a_cell_whose_holder_may_still_write_continues_in_a_new_run(study, capsys):
    """MLflow cannot refuse a late write, so a run whose holder may wake up is closed, not continued."""
    from tracking.record.lease import RELEASED_TAG, SUPERSEDED_TAG, Heartbeats, LeaseLost

    protocol, run = study
    client = MlflowClient()
    run()
    old = sorted(runs(client, "cell"), key=lambda r: r.data.tags["seed"])[1]
    # As an execution on another machine leaves it when that machine stalls or is cut off:
    # RUNNING, its lease expired, its process invisible from here (it may come back).
    client.update_run(old.info.run_id, status="RUNNING")
    for k, v in {
        HOST_TAG: "another-host",
        PID_TAG: "4242",
        TOKEN_TAG: "old",
        HEARTBEAT_TAG: "0",
    }.items():
        client.set_tag(old.info.run_id, k, v)
    client.delete_tag(old.info.run_id, RELEASED_TAG)
    shown = CliRunner().invoke(main, ["status", "--protocol", str(protocol_file(protocol))])
    assert shown.exit_code == 0, shown.output
    assert (
        f"-> next ablate: continue it in a new run (process 4242 on another-host cannot be seen from here: "
        f"it may still write to run {old.info.run_id})"
    ) in shown.output, shown.output
    capsys.readouterr()
    assert [o.status for o in run()] == ["skipped", "finished"]
    text = "".join(capsys.readouterr())
    now = client.get_run(old.info.run_id)
    new_id = now.data.tags[SUPERSEDED_TAG]
    assert (
        f"vit-seed1: continuing in a new run {new_id}: the holder of run {old.info.run_id}" in text
    ), text
    assert now.info.status == "KILLED" and "another-host" in now.data.tags[REASON_TAG]
    new = client.get_run(new_id)
    assert new.info.status == "FINISHED" and new.data.tags["continues_run"] == old.info.run_id
    assert new.data.tags["run_key"] == old.data.tags["run_key"]
    assert new.data.tags["mlflow.parentRunId"] == old.data.tags["mlflow.parentRunId"]
    # The new run holds the whole curve (from the checkpoint's history) and the summary, once.
    assert [m.step for m in client.get_metric_history(new_id, "val_accuracy")] == [1, 2]
    assert [m.step for m in client.get_metric_history(new_id, "test_accuracy")] == [2]
    models = client.search_logged_models(
        [new.info.experiment_id], filter_string=f"source_run_id = '{new_id}'"
    )
    assert [str(m.status).split(".")[-1] for m in models] == ["READY"]
    # The old holder, waking up, is fenced at its next check and told where the cell went.
    beats = Heartbeats()
    beats.hold(old.info.run_id, MlflowClient().tracking_uri, "old")
    with pytest.raises(LeaseLost, match=f"continues in run {new_id}"):
        beats.check(old.info.run_id, verify=True)
    shown = CliRunner().invoke(main, ["status", "--protocol", str(protocol_file(protocol))])
    assert f"vit/seed1: finished (run {new_id})" in shown.output, shown.output
    # A third execution skips both cells: the superseded run is history, not a cell to redo.
    assert [o.status for o in run()] == ["skipped", "skipped"]
    # Counted by cell, the closed run does not make the study look failed.
    (parent,) = runs(client, "parent")
    assert parent.info.status == "FINISHED", parent.data.metrics
    assert (
        parent.data.metrics["cells_finished"] == 2 and parent.data.metrics["cells_superseded"] == 1
    )
    assert parent.data.metrics["cells_killed"] == 0, parent.data.metrics


def test_a_shared_parent_stays_alive_while_any_of_its_executions_is(study):
    """Workers share the study's parent: the first one's death must not mark it KILLED under the others."""
    from tracking.record.lease import EXEC_PREFIX, execution_tag, lease_state, reap_expired

    _, run = study
    client = MlflowClient()
    run()
    (parent,) = runs(client, "parent")
    assert not [k for k in parent.data.tags if k.startswith(EXEC_PREFIX)], (
        "an ended execution keeps its lease tag"
    )
    host = __import__("socket").gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # The lease names the first execution (gone); a second one, alive, renews its own tag.
        client.update_run(parent.info.run_id, status="RUNNING")
        for k, v in {
            HOST_TAG: host,
            PID_TAG: str(dead_pid()),
            TOKEN_TAG: "shared",
            HEARTBEAT_TAG: "0",
            execution_tag("first"): f"{host} {dead_pid()} 0",
            execution_tag("second"): f"{host} {alive.pid} {__import__('time').time():.3f}",
        }.items():
            client.set_tag(parent.info.run_id, k, v)
        state = lease_state(client.get_run(parent.info.run_id))
        assert state.alive and state.pid == alive.pid, state
        assert reap_expired(client, parent.info.experiment_id) == []
        assert client.get_run(parent.info.run_id).info.status == "RUNNING"
    finally:
        alive.kill()
        alive.wait()
    reaped = reap_expired(client, parent.info.experiment_id)
    assert [r for r, _ in reaped] == [parent.info.run_id] and "all 2 executions are gone" in reaped[
        0
    ][1], reaped
    # The next execution clears the tags the dead ones left, and its own when it ends.
    run()
    tags = client.get_run(parent.info.run_id).data.tags
    assert not [k for k in tags if k.startswith(EXEC_PREFIX)], tags


def _artifact_files(client: MlflowClient, run_id: str, into: Path) -> list[Path]:
    folder = Path(client.download_artifacts(run_id, "", str(into)))
    return [p for p in folder.rglob("*") if p.is_file()]


SECRET_ARGV = [
    "workbench",
    "ablate",
    "--storage",
    "postgresql://mlflow:S3cretPW@db.example/optuna",
    "--password",
    "hunter22pw",
    "--api-token=tok-Secret-9",
    "--protocol",
    "rec.yaml",
]
SECRETS = ("S3cretPW", "hunter22pw", "tok-Secret-9")


def assert_no_secret(client: MlflowClient, runs_: list, into: Path) -> None:
    """No secret of SECRET_ARGV in any tag, param or artifact file of ``runs_`` (what a READ user can read)."""
    checked = 0
    for r in runs_:
        values = "\n".join(
            [*r.data.tags, *r.data.tags.values(), *r.data.params, *r.data.params.values()]
        )
        leaked = [s for s in SECRETS if s in values]
        assert not leaked, f"run {r.info.run_id}: {leaked} in its tags or params"
        folder = Path(client.download_artifacts(r.info.run_id, "", str(into / r.info.run_id)))
        for path in [p for p in folder.rglob("*") if p.is_file()]:
            leaked = [s for s in SECRETS if s.encode() in path.read_bytes()]
            assert not leaked, f"run {r.info.run_id}: {leaked} in artifact {path.name}"
            checked += 1
    assert checked > 10, checked
