"""Where runs go when the tracking server is away: the local fallback store.

A training run must never die because the tracking server died. When the configured store
(``tracking.store.uris``) is an HTTP server that cannot be reached (``tracking.store.health``),
runs go to a local SQLite store instead (``$WORKBENCH_OFFLINE_DIR``, default ``./mlflow-offline``,
with its artifacts beside it) and ``workbench sync`` copies them to the server later.
Wrong credentials are never a reason to go offline: they are refused at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.store import health, uris
from tracking.store.store_lock import ensure_store

OFFLINE_DIR_ENV = "WORKBENCH_OFFLINE_DIR"
DEFAULT_OFFLINE_DIR = "mlflow-offline"

# MLflow 3's UI opens an experiment on its GenAI overview unless the experiment says it
# holds model training (the values of the UI's ExperimentKind).
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"

_warned: set[str] = set()


def offline_dir() -> Path:
    return Path(os.environ.get(OFFLINE_DIR_ENV) or DEFAULT_OFFLINE_DIR).resolve()


def fallback_uri() -> str:
    return f"sqlite:///{offline_dir() / 'mlflow.db'}"


def fallback_exists() -> bool:
    return (offline_dir() / "mlflow.db").exists()


def fallback_client() -> MlflowClient:
    offline_dir().mkdir(parents=True, exist_ok=True)
    ensure_store(fallback_uri())  # two runs going offline at once must not both create its tables
    return MlflowClient(fallback_uri())


def ensure_experiment(client: MlflowClient, name: str) -> str:
    """Experiment id of ``name`` in ``client``'s store, created if missing.

    In the fallback store the artifact location is set explicitly, beside the database:
    SQLite stores otherwise put artifacts under ./mlruns of whatever folder is current.
    """
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before experiments were marked
            with contextlib.suppress(MlflowException):
                client.set_experiment_tag(
                    exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND
                )
        return exp.experiment_id
    location = None
    if client.tracking_uri == fallback_uri():
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80] or "experiment"
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        location = (offline_dir() / "artifacts" / f"{safe}-{digest}").as_uri()
    try:
        return client.create_experiment(
            name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
        )
    except MlflowException:  # created meanwhile by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def fallback_run_exists(run_id: str) -> bool:
    """Whether ``run_id`` lives in the local fallback store (ids are UUIDs: no clashes with the server)."""
    if not fallback_exists():
        return False
    try:
        fallback_client().get_run(run_id)
        return True
    except MlflowException:
        return False


def forget_health() -> None:
    """Drop remembered probe results and warnings (tests restart servers on the same address)."""
    health.forget_probes()
    _warned.clear()


def warn_offline(uri: str, reason: str, what: str = "runs") -> None:
    """One line per server and process: where the runs go instead and how they get back."""
    if uri in _warned:
        return
    _warned.add(uri)
    print(
        f"WARNING: tracking server {uris.redact_uri(uri)} unreachable ({reason}); {what} go to the local store "
        f"{fallback_uri()}. Copy them to the server later with `workbench sync`.",
        file=sys.stderr,
        flush=True,
    )


def active_store_uri() -> str:
    """The store new runs should go to now: the configured one, or the fallback while a server is away."""
    uri = uris.tracking_uri()
    if not uris.is_remote(uri):
        return uri
    uris.apply_http_defaults()
    state = health.server_state(uri)
    if state == "up":
        return uri
    warn_offline(uri, state)
    return fallback_uri()


def go_offline_or_raise(uri: str, err: BaseException) -> None:
    """After a failed call to ``uri``: re-raise unless the server is unreachable, else record and warn.

    Wrong credentials and ordinary errors propagate; only an outage sends runs offline.
    """
    health.raise_if_auth_failure(uri, err)
    if not health.is_unreachable(err):
        raise err
    health.mark_down(uri, health.describe_failure(err))
    warn_offline(uri, health.describe_failure(err))


def use_folder_store(folder: Path, experiment: str) -> str:
    """Send this process's runs to a SQLite store of its own in ``folder``; returns its URI.

    For a re-training that must not meet the cells of the user's store (they would be skipped
    as finished): ``workbench reproduce``. The experiment is created with its artifacts beside
    the database (a SQLite store otherwise puts them under ./mlruns of the current folder), and
    MLFLOW_TRACKING_URI is set so that ``configure_tracking`` and child processes find it.
    """
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    ensure_store(uri)
    client = MlflowClient(uri)
    if client.get_experiment_by_name(experiment) is None:
        with contextlib.suppress(MlflowException):  # created meanwhile by another process
            client.create_experiment(
                experiment,
                artifact_location=(folder / "artifacts").as_uri(),
                tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND},
            )
    return uri
