"""scripts/remote_gpu.sh run as a user would, on the CPU (WORKBENCH_DEVICE=cpu), against a local basic-auth server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import isolated_tracking, workbench_server  # noqa: F401
from test_ablate import write_protocol

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "remote_gpu.sh"
ADMIN = ("trainer", "remote-script-Passw0rd")


@pytest.mark.integration
@pytest.mark.slow  # a server and a 4-cell study in subprocesses (about 40 s)
def test_the_remote_script_trains_a_protocol_onto_the_server_and_syncs(
    isolated_tracking, tmp_path, monkeypatch
):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path)
    with workbench_server(
        f"sqlite:///{tmp_path / 'server.db'}",
        tmp_path / "artifacts",
        ADMIN,
        auth_db=f"sqlite:///{tmp_path / 'auth.db'}",
    ) as server:
        # the venv running the tests, by absolute path
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": server.url,
            "MLFLOW_TRACKING_USERNAME": ADMIN[0],
            "MLFLOW_TRACKING_PASSWORD": ADMIN[1],
            "WORKBENCH_DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
            "VENV": str(Path(sys.executable).parent.parent),
        }
        done = subprocess.run(
            [
                "bash",
                str(SCRIPT),
                "ablate",
                "--protocol",
                str(protocol),
                "--allow-dirty",
                "--data-path",
                str(folder),
                "--output-dir",
                str(tmp_path / "out"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]
        assert ADMIN[1] not in out, "the password reached the console"
        assert (
            "device: cpu (WORKBENCH_DEVICE)" in out and "cells: 4 run, 0 already finished" in out
        ), out[-3000:]
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
        client = MlflowClient(server.url)
        exp = client.get_experiment_by_name("tiny")
        runs = client.search_runs([exp.experiment_id], "")
        cells = [r for r in runs if r.data.tags.get("cell") == "true"]
        parents = [r for r in runs if r.data.tags.get("parent") == "true"]
        assert sorted(r.info.status for r in cells) == ["FINISHED"] * 4 and [
            p.info.status for p in parents
        ] == ["FINISHED"]
        assert {r.data.tags["mlflow.user"] for r in runs} == {ADMIN[0]}, (
            "runs belong to the account that logged in"
        )
        assert {r.data.tags["device"] for r in cells} == {"cpu"}, {
            r.data.tags.get("device") for r in cells
        }
    # The server was up throughout: the closing `workbench sync` ran and found nothing logged offline.
    assert "no local runs:" in done.stdout and not (isolated_tracking / "mlflow.db").exists(), (
        done.stdout[-2000:]
    )
