"""Run identity and the MLflow session: the one place that decides where runs go.

The embedded default is a SQLite store in the working directory (``sqlite:///mlflow.db``);
MLFLOW_TRACKING_URI (and MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for a
server) override it, as everywhere in MLflow. MLflow reads the credentials itself; this
project never logs, tags or prints them (``tracking.store.redact``). On a server with basic-auth
a run's ``mlflow.user`` is the account that logged in (``run_user``), not the OS user.
When the server cannot be reached, runs go to a local fallback store instead
(``tracking.store.offline_store``), to be copied over later by ``workbench sync``.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import platform
import subprocess
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

import mlflow

from tracking.store import health, offline_store, uris
from tracking.store.child_env import git_env
from tracking.store.uris import DEFAULT_TRACKING_URI, redact_uri  # noqa: F401  (re-exported)


class StoreUnavailableError(RuntimeError):
    """A reader's store is not there (no such SQLite file, or a server that does not answer); said in one line."""


def configure_tracking(allow_offline: bool = True) -> str:
    """Point MLflow at MLFLOW_TRACKING_URI or the embedded SQLite default; return the URI in use.

    A tracking server is probed first (a few seconds at most): wrong credentials raise
    ``TrackingAuthError``; an unreachable server sends this process's runs to the local
    fallback store, with one warning naming it. Code that only reads runs (reports)
    passes ``allow_offline=False``: an answer from the wrong store would be worse than none.
    """
    from tracking.store.storage_guard import (
        check_sqlite_file,
        check_sqlite_writable,
        refuse_optuna_database,
    )

    # a file that is not SQLite: named
    check_sqlite_file(uris.tracking_uri(), "MLFLOW_TRACKING_URI")
    # Optuna's database: before MLflow writes
    refuse_optuna_database(uris.tracking_uri(), "MLFLOW_TRACKING_URI")
    if not allow_offline:
        uri = uris.tracking_uri()
        store = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        if store is not None and not store.exists():
            # Opening it would create an empty store here: a reader only says what is missing.
            raise StoreUnavailableError(
                f"no MLflow store at {uri} ({store.resolve()} does not exist): nothing was "
                "run against it; set MLFLOW_TRACKING_URI to the store that holds the runs"
            )
        if uris.is_remote(uri):
            state = health.server_state(uri)
            if state != "up":
                raise StoreUnavailableError(
                    f"tracking server {uris.redact_uri(uri)} unreachable ({state})"
                )
        uris.set_process_uri(uri)
        return uri
    check_sqlite_writable(uris.tracking_uri(), "MLFLOW_TRACKING_URI")  # before any run is opened
    uri = offline_store.active_store_uri()
    uris.set_process_uri(uri)
    return uri


def run_user() -> str:
    """Who a new run belongs to, for its ``mlflow.user`` tag (the UI's "Created by").

    On a tracking server with accounts it is the account the server authenticated
    (``health.server_account``: the server's word, not a name this client sets). While the
    server cannot be asked (away: runs kept in the local fallback store, synced later), the
    account that logs in: MLFLOW_TRACKING_USERNAME, else the user name in MLFLOW_TRACKING_URI
    (``https://alice:...@host``), as MLflow itself chooses them. Otherwise WORKBENCH_USER,
    else the OS user, as MLflow would say.
    """
    uri = uris.tracking_uri()
    if uris.is_remote(uri):
        account = (
            health.server_account(uri)
            or os.environ.get("MLFLOW_TRACKING_USERNAME")
            or unquote(urlsplit(uri).username or "")
        )
        if account:
            return account
    with contextlib.suppress(Exception):  # getpass raises when the uid has no name (containers)
        return os.environ.get("WORKBENCH_USER") or getpass.getuser()
    return "unknown"


def git_state(path: Path | None = None) -> dict[str, str]:
    """Commit and dirty flag of the project checkout ("unknown" outside git)."""
    cwd = path or Path(__file__).resolve().parents[2]  # the checkout (tracking/store/session.py)

    def git(*args: str) -> str:
        # An allow-list environment: git needs no tracking account, database or queue URL.
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=git_env()
        ).stdout.strip()

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
    from workbench.train.fingerprint import current_code_fingerprint

    return {**tags, **git_state(), "code_fingerprint": current_code_fingerprint()}


@contextlib.contextmanager
def start_run(
    experiment: str, run_name: str | None = None, tags: dict | None = None
) -> Iterator[mlflow.ActiveRun]:
    """Start (or, under ``mlflow run``, continue) a run in ``experiment``.

    ``mlflow run`` creates the run itself and passes MLFLOW_RUN_ID; then the run already
    belongs to the experiment chosen on the command line and is simply resumed.
    """
    uri = configure_tracking()
    if not os.environ.get("MLFLOW_RUN_ID"):
        # ensure_experiment puts a fallback experiment's artifacts beside the fallback store
        mlflow.set_experiment(
            experiment_id=offline_store.ensure_experiment(mlflow.MlflowClient(uri), experiment)
        )
    # MLflow's own default is the OS user; a run continued under `mlflow run` gets the tag too.
    with mlflow.start_run(run_name=run_name, tags={"mlflow.user": run_user()}) as run:
        if uri == offline_store.fallback_uri():
            from tracking.record.sink import offline_tags

            mlflow.set_tags(offline_tags("server unreachable when the run started"))
        if tags:
            mlflow.set_tags({k: uris.scrub(v) for k, v in tags.items()})
        yield run
