"""Addresses of MLflow UI pages to print: no credentials, and on the training-runs pages.

MLflow 3.17's UI does not read the experiment's ``mlflow.experimentKind`` tag to choose
between its GenAI pages and its model-training pages: it reads the ``workflowType`` URL
parameter, else what this browser chose last, else GenAI. A bare experiment address so
opens on the GenAI overview ("Traces 0") for a first-time visitor; with
``workflowType=machine_learning`` it opens on the runs list. Every address the workbench
prints carries it (the experiment tag is still set for UIs that read it).

A view of the runs list (search filter, sort, chosen columns) travels as MLflow's own shared
view: the experiment tag ``mlflow.sharedViewState.<key>`` holds the view as JSON, and an
address with ``viewStateShareKey=<key>`` opens the runs list in it (``share_view``). The
experiment tag ``ANSWER_VIEW`` names the view a report chose for the study's answer (one row
per arm, ``tracking.record.report_summary``); ``experiment_lines`` prints that view's address.
"""

from __future__ import annotations

import hashlib
import json
from urllib.parse import urlsplit, urlunsplit

WORKFLOW_QUERY = "workflowType=machine_learning"
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."  # MLflow UI's experiment tag of a shared view
SHARE_QUERY = "viewStateShareKey"
ANSWER_VIEW = "answer_view"  # experiment tag: the share key of the view showing the study's answer


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


def view_url(uri: str, experiment_id: str, key: str) -> str | None:
    """The experiment's runs list in the shared view ``key`` (None for a local store)."""
    runs = experiment_url(uri, experiment_id)
    return f"{runs}&{SHARE_QUERY}={key}" if runs else None


def share_view(client, experiment_id: str, view: dict) -> str:
    """Store ``view`` (search facets and table state, as the UI shares them) on the experiment; its key.

    The key is the view's sha256, so the same view is stored once and a changed view gets a new
    address. The UI reads only the keys it knows (``searchFilter``, ``orderByKey``,
    ``orderByAsc``, ``selectedColumns``, ``columnOrder``, ``columnWidths``, ...) and takes the
    others from its defaults.
    """
    value = json.dumps(view, sort_keys=True)
    key = hashlib.sha256(value.encode("utf-8")).hexdigest()
    client.set_experiment_tag(experiment_id, SHARED_VIEW_PREFIX + key, value)
    return key


def column(kind: str, key: str) -> str:
    """A runs-table column as MLflow's UI names it: ``metrics.`val.acc```, ``tags.`reference```."""
    return f"{kind}.`{key}`"


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
    return [_experiment_line(e, ui_url) for e in sorted(used, key=lambda e: e.name)]


def _experiment_line(experiment, ui_url: str) -> str:
    """The runs list of ``experiment``: in the view of its answer where a report chose one."""
    key = experiment.tags.get(ANSWER_VIEW)
    if key and SHARED_VIEW_PREFIX + key in experiment.tags:
        return (
            f"runs of {experiment.name} (the answer: one row per arm): "
            f"{view_url(ui_url, experiment.experiment_id, key)}"
        )
    return f"runs of {experiment.name}: {experiment_url(ui_url, experiment.experiment_id)}"


if (
    __name__ == "__main__"
):  # `make ui`: where each study's runs are, before the UI starts (argv: store URI, UI address)
    import sys

    print("\n".join(experiment_lines(sys.argv[1], sys.argv[2])), flush=True)
