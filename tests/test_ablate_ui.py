"""The study as a user meets it: a real `mlflow server`, the experiment page in headless Chromium, no password printed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder
from servers import mlflow_server
from test_ablate_record import PROTOCOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a real server and Chromium, 30 s
ROOT = Path(__file__).resolve().parent.parent
BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-extensions",
]
PASSWORD = "pw-7Hq2-never-printed"


def test_experiment_page_lists_the_parent_and_its_cells_and_no_password_is_printed(tmp_path):
    if BROWSER is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "rec.yaml"
    path.write_text(PROTOCOL.format(name="rec", epochs=1, seeds="[0, 1]"))
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        # A server without auth ignores the credentials; what matters is that they never get printed.
        secret_uri = url.replace("http://", f"http://user:{PASSWORD}@")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": secret_uri,
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        }
        env.pop("MLFLOW_RUN_ID", None)
        env.pop("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", None)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "studies.cli",
                "ablate",
                "--protocol",
                str(path),
                "--allow-dirty",
                "--data-path",
                str(folder),
                "--device",
                "cpu",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-3000:]
        assert PASSWORD not in output, [line for line in output.splitlines() if PASSWORD in line][
            :3
        ]
        status = subprocess.run(
            [sys.executable, "-m", "studies.cli", "status", "--protocol", str(path)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert status.returncode == 0 and PASSWORD not in status.stdout + status.stderr, (
            status.stdout + status.stderr
        )

        client = MlflowClient(url)
        exp = client.get_experiment_by_name("rec")
        assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
        (parent,) = client.search_runs([exp.experiment_id], "tags.parent = 'true'")
        # The address ablate prints opens on the runs list, not on MLflow 3.17's GenAI overview
        # (whose choice follows the workflowType parameter, not the experiment's kind tag).
        printed = re.search(r"^MLflow UI \(runs of this study\): (\S+)$", output, re.M)
        assert printed, output[-3000:]
        assert (
            printed.group(1)
            == f"{url}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        )
        dom = text_of(open_page(tmp_path, printed.group(1)))
        assert parent.info.run_name in dom, (
            f"parent {parent.info.run_name} not on the experiment page:\n{dom[:3000]}"
        )
        # The runs page of the model-training views ("Runs - Experiment N"), not "Overview" or "Traces".
        assert (
            dom.strip().startswith(f"Runs - Experiment {exp.experiment_id}")
            and "3 matching runs" in dom
        ), dom[:3000]
        assert (
            "(" + printed.group(1).replace("/runs?", f"/runs/{parent.info.run_id}?") + ")"
            in status.stdout
        )
        # The cells sit under their parent (collapsed in the list); the parent's page names them, and its description.
        page = text_of(
            open_page(
                tmp_path, f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
            )
        )
        children = re.search(r"Child runs (.*?) Source", page)
        assert children and sorted(children.group(1).split(" , ")) == ["vit-seed0", "vit-seed1"], (
            page[:3000]
        )
        assert "one-arm protocol for record tests" in page and "cells 2" in page, page[:3000]
        assert re.search(r"Created by \S+", page) and "Created by —" not in page, page[:3000]


TWO_ARMS = PROTOCOL.replace(
    "description: one-arm protocol for record tests", "description: two-arm protocol for the UI"
).replace(
    "  - {{name: vit, reference: true}}\n",
    "  - {{name: vit, reference: true}}\n  - {{name: wide, overrides: {{model: {{dim: 32}}}}}}\n",
)


def test_the_parent_run_page_shows_the_reports_comparison(tmp_path):
    """After `workbench report`, the parent's page in the UI shows the stated result and the cmp.* metrics."""
    if BROWSER is None:
        pytest.skip("headless Chromium not installed (Debian: apt-get install chromium)")
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    path = tmp_path / "ui2.yaml"
    path.write_text(TWO_ARMS.format(name="ui2", epochs=1, seeds="[0, 1]"))
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts") as url:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MLFLOW_TRACKING_URI": url,
            "OMP_NUM_THREADS": "1",
            "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"),
        }
        env.pop("MLFLOW_RUN_ID", None)
        for args in (
            [
                "ablate",
                "--protocol",
                str(path),
                "--allow-dirty",
                "--data-path",
                str(folder),
                "--device",
                "cpu",
                "--output-dir",
                str(tmp_path / "out"),
            ],
            [
                "report",
                "--protocol",
                str(path),
                "--out-dir",
                str(tmp_path / "reports"),
                "--resamples",
                "200",
            ],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "studies.cli", *args],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "the report's 2 comparisons as metrics (cmp.*)" in done.stdout, done.stdout
        client = MlflowClient(url)
        exp = client.get_experiment_by_name("ui2")
        (parent,) = client.search_runs([exp.experiment_id], "tags.parent = 'true'")
        md = (tmp_path / "reports" / "ui2" / "report.md").read_text()
        stated = next(
            line[2:]
            for line in md.splitlines()
            if line.startswith("> On validation, wide minus vit")
        )
        address = f"{url}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning"
        assert f"in the MLflow UI: {address}" in done.stdout, (
            done.stdout
        )  # report prints the parent's page
        page = text_of(open_page(tmp_path, address))
        assert "Description Results of the report: ui2@" in page, page[:3000]
        # The page shows the description's first result (collapsed after it) and every cmp.* metric of the run.
        assert " ".join(stated.split())[:60] in page, (stated, page[:3000])
        shown = repr(parent.data.metrics["cmp.wide_vs_vit.val.mean_diff"]).removesuffix(
            ".0"
        )  # as JavaScript prints it
        assert f"cmp.wide_vs_vit.val.mean_diff {shown}" in page, page[:4000]


def text_of(dom: str) -> str:
    text = re.sub(r"<style.*?</style>|<script.*?</script>", "", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))


def open_page(tmp_path: Path, page: str) -> str:
    """The DOM after the single-page app has loaded its data (virtual time lets its requests finish)."""
    return subprocess.run(
        [
            BROWSER,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=30000",
            "--dump-dom",
            page,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    ).stdout
