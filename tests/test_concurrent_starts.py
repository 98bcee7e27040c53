"""Two executions of one study started in the same second: a normal case, not a race to lose."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.entities import Param, ViewType
from mlflow.tracking import MlflowClient

from tracking.record.lease import EXEC_PREFIX, Heartbeats

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = """\
name: rec
description: one-arm protocol for concurrent starts
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 1, batch_size: 8}
arms:
  - {name: vit, reference: true}
seeds: [0, 1]
"""


def everything(uri: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("rec")
    return client.search_runs([exp.experiment_id], "", ViewType.ALL) if exp else []


def records(uri: str, run_id: str) -> list[dict]:
    client = MlflowClient(uri)
    return [
        json.loads(Path(client.download_artifacts(run_id, a.path)).read_text())
        for a in client.list_artifacts(run_id, "executions")
    ]


@pytest.mark.slow
def test_ten_pairs_started_together_on_new_and_used_stores_share_one_clean_parent(
    tmp_path, empty_mlflow_db
):
    """Before: `table latest_metrics already exists` on a new file, an IntegrityError on params, deleted parents left RUNNING."""
    rounds = 10
    for k in range(rounds):
        here = tmp_path / f"round{k}"
        here.mkdir()
        (here / "rec.yaml").write_text(PROTOCOL)
        if k % 2:  # odd rounds: a store in use already; even rounds: a brand-new file
            shutil.copyfile(empty_mlflow_db, here / "mlflow.db")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
    }
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "scripts" / "open_parent_rounds.py"),
        str(tmp_path),
        str(rounds),
    ]
    sides = [
        subprocess.Popen(
            cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [side.communicate(timeout=900) for side in sides]
    said = [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for out, _ in outputs
    ]
    errors = [r for side in said for r in side if "error" in r]
    assert not errors and all(s.returncode == 0 for s in sides), (
        json.dumps(errors, indent=1)[-4000:] + outputs[0][1][-2000:]
    )
    for k in range(rounds):
        uri = f"sqlite:///{tmp_path / f'round{k}' / 'mlflow.db'}"
        runs = everything(uri)
        where = f"round {k} ({'new' if k % 2 == 0 else 'used'} store): " + repr(
            [(r.info.run_id, r.info.status, r.info.lifecycle_stage) for r in runs]
        )
        assert {said[0][k]["parent"], said[1][k]["parent"]} == {
            r.info.run_id for r in runs if r.info.lifecycle_stage == "active"
        }, where
        assert not [r for r in runs if r.info.status == "RUNNING"], where
        (parent,) = [r for r in runs if r.info.lifecycle_stage == "active"]
        assert not [t for t in parent.data.tags if t.startswith(EXEC_PREFIX)], (
            f"{where}: {parent.data.tags}"
        )
        closed = records(uri, parent.info.run_id)
        assert len(closed) == 2 and all(r["end"] and r["outcome"] == "completed" for r in closed), (
            closed
        )


@pytest.mark.parametrize("theirs", ["the same text", "another text"])
def test_a_param_another_execution_logged_first_is_no_error_when_it_is_the_same(
    mlflow_store, monkeypatch, theirs
):
    """Before: `UNIQUE constraint failed: params.key, params.run_uuid` (protocol_description) crashed the second start."""
    from mlflow.exceptions import MlflowException

    from tracking.record.sink import RunSink

    client = MlflowClient()
    run = client.create_run(client.create_experiment("rec"))
    ours = RunSink.attach(run, mlflow_store, "rec")
    real, raced = MlflowClient.log_batch, []

    def racing(self, run_id, metrics=(), params=(), tags=(), **kw):
        if params and not raced:  # both looked, neither found it; the other inserted first
            raced.append(True)
            real(self, run_id, params=[Param("protocol_description", theirs)])
            raise MlflowException(
                "(sqlite3.IntegrityError) UNIQUE constraint failed: params.key, params.run_uuid"
            )
        return real(self, run_id, metrics, params, tags, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", racing)
    if theirs != "the same text":
        with pytest.raises(MlflowException, match="UNIQUE"):
            ours.log_params({"protocol_description": "the same text", "other": 1})
        return
    ours.log_params({"protocol_description": "the same text", "other": 1})
    assert client.get_run(run.info.run_id).data.params == {
        "protocol_description": "the same text",
        "other": "1",
    }


def test_a_new_store_gets_its_tables_under_the_lock(tmp_path):
    from tracking.store.store_lock import ensure_store, store_lock

    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    held, done = threading.Event(), threading.Event()

    def other_process_creating_it():  # holds the lock as another process would
        with store_lock(uri):
            held.set()
            done.wait(30)

    holder = threading.Thread(target=other_process_creating_it)
    holder.start()
    held.wait(30)
    opener = threading.Thread(target=ensure_store, args=(uri,))
    opener.start()
    time.sleep(0.5)
    assert opener.is_alive() and not (tmp_path / "new" / "mlflow.db").exists(), (
        "the store was opened without the lock"
    )
    done.set()
    opener.join(60)
    holder.join(30)
    assert MlflowClient(uri).search_experiments()  # created, with its default experiment


def test_a_parent_closed_while_a_heartbeat_is_under_way_gets_no_late_lease_tag(
    mlflow_store, monkeypatch
):
    """Before: a beat that had read the run before the release wrote its execution tag after the close."""
    client = MlflowClient()
    run = client.create_run(client.create_experiment("rec"))
    beats, in_beat, go_on = Heartbeats(), threading.Event(), threading.Event()
    # no beats of its own thread: the test beats
    beats._wake.wait = lambda timeout=None: time.sleep(3600)
    real_get_run = MlflowClient.get_run

    def slow_get_run(self, run_id):
        found = real_get_run(self, run_id)
        if threading.current_thread().name == "beat":
            in_beat.set()
            go_on.wait(30)
        return found

    monkeypatch.setattr(MlflowClient, "get_run", slow_get_run)
    beats.hold(run.info.run_id, mlflow_store, "tok", EXEC_PREFIX + "mine")
    beat = threading.Thread(target=beats._beat, args=(run.info.run_id,), name="beat")
    beat.start()
    in_beat.wait(30)
    released = threading.Thread(target=beats.release, args=(run.info.run_id,))
    released.start()
    time.sleep(0.3)
    assert released.is_alive(), "release returned while a beat was still writing"
    go_on.set()
    released.join(30)
    beat.join(30)
    # what the closing execution does after release
    client.delete_tag(run.info.run_id, EXEC_PREFIX + "mine")
    beats._beat(run.info.run_id)  # not held any more: writes nothing
    assert EXEC_PREFIX + "mine" not in real_get_run(client, run.info.run_id).data.tags


def test_two_executions_reattaching_one_killed_run_together_both_get_it(mlflow_store):
    """Both read the run while it still had ``killed_reason``; the first moves it to the history and
    deletes it, so the second's delete finds nothing. In CI a worker died at start on that
    (RESOURCE_DOES_NOT_EXIST) beside another worker that had just reattached the parent."""
    from tracking.record.sink import HISTORY_TAG, RunSink

    client = MlflowClient()
    exp = client.create_experiment("rec")
    run_id = client.create_run(exp, tags={"killed_reason": "process 1 on vm is gone"}).info.run_id
    client.set_terminated(run_id, "KILLED")
    # both before either attaches
    first_read, second_read = (
        client.get_run(run_id),
        client.get_run(run_id),
    )
    RunSink.attach(first_read, mlflow_store, "rec")
    RunSink.attach(second_read, mlflow_store, "rec")
    run = client.get_run(run_id)
    assert run.info.status == "RUNNING" and "killed_reason" not in run.data.tags, run.data.tags
    assert "killed_reason=process 1 on vm is gone" in run.data.tags[HISTORY_TAG], run.data.tags[
        HISTORY_TAG
    ]
