"""Addresses of MLflow UI pages to print: no credentials, and on the training-runs pages.

MLflow 3.17's UI does not read the experiment's ``mlflow.experimentKind`` tag to choose
between its GenAI pages and its model-training pages: it reads the ``workflowType`` URL
parameter, else what this browser chose last, else GenAI. A bare experiment address so
opens on the GenAI overview ("Traces 0") for a first-time visitor; with
``workflowType=machine_learning`` it opens on the runs list. Every address the workbench
prints carries it (the experiment tag is still set for UIs that read it).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

WORKFLOW_QUERY = "workflowType=machine_learning"


def _base(uri: str) -> str | None:
    """The server's address without user name or password; None for a store that has no UI address."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")


def experiment_url(uri: str, experiment_id: str) -> str | None:
    """The experiment's runs list in the UI of the server at ``uri`` (None for a local store)."""
    base = _base(uri)
    return f"{base}/#/experiments/{experiment_id}/runs?{WORKFLOW_QUERY}" if base and experiment_id else None


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """One run's page in the UI of the server at ``uri`` (None for a local store)."""
    base = _base(uri)
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW_QUERY}" if base and experiment_id else None
