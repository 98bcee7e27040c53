"""Distributed ablation: cells queued in Optuna on a real PostgreSQL, two workers, one SIGKILLed mid-cell.

Every cell must finish exactly once in MLflow (logged through a real tracking server on
127.0.0.1 with a PostgreSQL backend store), with each epoch's metrics logged once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import mlflow_server, postgres_server
from test_ablate import write_protocol

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict, cwd: Path, **kw):
    return subprocess.Popen([sys.executable, "-m", "studies.cli", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_two_workers_one_killed_every_cell_exactly_once(tmp_path, monkeypatch):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=4)
    with postgres_server(("optuna", "mlflow")) as pg, mlflow_server(f"{pg}/mlflow", tmp_path / "artifacts") as url:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": url,
               "WORKBENCH_CACHE_DIR": str(tmp_path / "cache")}
        env.pop("MLFLOW_RUN_ID", None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        storage = f"{pg}/optuna"
        queued = cli("ablate", "--protocol", str(protocol), "--allow-dirty", "--storage", storage, env=env, cwd=tmp_path)
        out, _ = queued.communicate(timeout=300)
        assert queued.returncode == 0 and "queued 4 cells" in out, out

        common = ["--storage", storage, "--data-path", str(folder), "--device", "cpu",
                  "--output-dir", str(tmp_path / "out"), "--heartbeat", "1", "--grace", "4"]
        victim_log = open(tmp_path / "victim.log", "w")
        victim = subprocess.Popen([sys.executable, "-m", "studies.cli", "worker", *common], env=env, cwd=tmp_path,
                                  stdout=victim_log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        survivor = cli("worker", *common, env=env, cwd=tmp_path)
        client = MlflowClient(url)
        study = optuna.load_study(study_name="cells:tiny@" + _short_hash(protocol), storage=storage)
        # Kill the victim once its first cell has logged an epoch but not finished.
        killed_run, deadline = None, time.monotonic() + 300
        while time.monotonic() < deadline and killed_run is None and victim.poll() is None:
            started = re.findall(r"cell \d+: (\w+)/seed(\d+)", (tmp_path / "victim.log").read_text())
            exp = client.get_experiment_by_name("tiny")
            if started and exp:
                arm, seed = started[0]
                found = client.search_runs([exp.experiment_id], f"tags.arm = '{arm}' and tags.seed = '{seed}'")
                if found and found[0].info.status == "RUNNING" and client.get_metric_history(found[0].info.run_id, "val_accuracy"):
                    killed_run = found[0]
            time.sleep(0.1)
        assert killed_run is not None, "the victim never had a cell with a logged epoch:\n" + (tmp_path / "victim.log").read_text()[-3000:]
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=60)
        victim_log.close()

        out, _ = survivor.communicate(timeout=600)
        assert survivor.returncode == 0, out[-4000:]
        runs = client.search_runs([exp.experiment_id], "tags.cell = 'true'")
        keys = sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in runs)
        assert keys == sorted([("vit", "0"), ("cnn", "0"), ("vit", "1"), ("cnn", "1")]), keys
        for run in runs:
            assert run.info.status == "FINISHED", (run.data.tags["mlflow.runName"], run.info.status)
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")]
            assert steps == [1, 2, 3, 4], f"{run.data.tags['mlflow.runName']}: epochs logged {steps}"
            artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "predictions")}
            assert "predictions/val.csv" in artifacts
        resumed = client.get_run(killed_run.info.run_id)
        assert resumed.info.status == "FINISHED" and resumed.data.tags["resumed"] == "true", "the killed cell continued in its own run"
        states = [t.state for t in study.get_trials(deepcopy=False)]
        assert states.count(optuna.trial.TrialState.COMPLETE) == 4, states
        assert optuna.trial.TrialState.FAIL in states  # the dead worker's stale trial
        parent = client.get_run(runs[0].data.tags["mlflow.parentRunId"])
        assert parent.info.status == "FINISHED"


def _short_hash(protocol_path: Path) -> str:
    from studies.protocol import load_protocol

    return load_protocol(protocol_path).short_hash
