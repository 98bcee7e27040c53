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
    return (
        f"{base}/#/experiments/{experiment_id}/runs?{WORKFLOW_QUERY}"
        if base and experiment_id
        else None
    )


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """One run's page in the UI of the server at ``uri`` (None for a local store)."""
    base = _base(uri)
    return (
        f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW_QUERY}"
        if base and experiment_id
        else None
    )


def experiment_lines(store_uri: str, ui_url: str) -> list[str]:
    """One line per experiment of ``store_uri`` with the address of its runs list in the UI served at ``ui_url``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store_uri)
    used = [
        e
        for e in client.search_experiments()  # MLflow's empty "Default" experiment is no study's
        if e.name != "Default" or client.search_runs([e.experiment_id], max_results=1)
    ]
    if not used:
        return [
            f"no experiments in {store_uri} yet: `make run` makes the smoke study's; the UI: {_base(ui_url)}/"
        ]
    return [
        f"runs of {e.name}: {experiment_url(ui_url, e.experiment_id)}"
        for e in sorted(used, key=lambda e: e.name)
    ]


if (
    __name__ == "__main__"
):  # `make ui`: where each study's runs are, before the UI starts (argv: store URI, UI address)
    import sys

    print("\n".join(experiment_lines(sys.argv[1], sys.argv[2])), flush=True)
