"""Run identity and the MLflow session: the one place that decides where runs go.

The embedded default is a SQLite store in the working directory (``sqlite:///mlflow.db``);
MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for a
server) override it, as everywhere in MLflow.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Iterator

import mlflow

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def configure_tracking() -> str:
    """Point MLflow at MLFLOW_TRACKING_URI or the embedded SQLite default; return the URI."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    mlflow.set_tracking_uri(uri)
    return uri


def git_state(path: Path | None = None) -> dict[str, str]:
    """Commit and dirty flag of the project checkout ("unknown" outside git)."""
    cwd = path or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}
    return {"git_commit": commit, "git_dirty": str(dirty).lower()}


def environment_tags(device: str) -> dict[str, str]:
    import timm
    import torch

    tags = {
        "device": device,
        "torch_version": torch.__version__,
        "timm_version": timm.__version__,
        "python_version": platform.python_version(),
        "cpu_threads": str(torch.get_num_threads()),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        tags["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return {**tags, **git_state()}


@contextlib.contextmanager
def start_run(experiment: str, run_name: str | None = None, tags: dict | None = None) -> Iterator[mlflow.ActiveRun]:
    """Start (or, under ``mlflow run``, continue) a run in ``experiment``.

    ``mlflow run`` creates the run itself and passes MLFLOW_RUN_ID; then the run already
    belongs to the experiment chosen on the command line and is simply resumed.
    """
    configure_tracking()
    if not os.environ.get("MLFLOW_RUN_ID"):
        mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        if tags:
            mlflow.set_tags(tags)
        yield run
