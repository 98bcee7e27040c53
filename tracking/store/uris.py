"""The configured tracking store: its URI, whether it is a server, and how it is shown.

The configured store is MLFLOW_TRACKING_URI (credentials in MLFLOW_TRACKING_USERNAME /
MLFLOW_TRACKING_PASSWORD, as everywhere in MLflow), else the embedded SQLite default. Where runs
go *now* (the configured store, or the local fallback while a server is away) is
``tracking.store.offline_store.active_store_uri``.
"""

from __future__ import annotations

import os

import mlflow

from tracking.store import redact
from tracking.store.store_lock import ensure_store

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# Applied only when the user has not set them: short enough that a dead server costs a run
# seconds, long enough to ride out a server restart or a slow upload.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}


def tracking_uri() -> str:
    """The configured store: MLFLOW_TRACKING_URI or the embedded SQLite default."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def redact_uri(uri: str) -> str:
    """``https://user:pw@host/x`` -> ``https://***@host/x``: safe to print, tag or log (``tracking.store.redact``)."""
    return redact.redact_url(uri)


def scrub(value) -> str:
    """A param or tag value with URL userinfo, secret options and secret env values replaced by ***."""
    return redact.redact_text(value)


def apply_http_defaults() -> None:
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def process_uri() -> str:
    """The store this process's MLflow calls go to now (``set_process_uri``'s, or the fallback's)."""
    return mlflow.get_tracking_uri()


def set_process_uri(uri: str) -> None:
    """Point this process's MLflow calls at ``uri`` and leave MLFLOW_TRACKING_URI as the user set it.

    ``mlflow.set_tracking_uri`` also rewrites the environment variable; after a fallback
    that would make this process (and every subprocess) forget which server it serves.
    """
    configured = os.environ.get("MLFLOW_TRACKING_URI")
    ensure_store(uri)  # a new SQLite file gets its tables from one process, not two at once
    mlflow.set_tracking_uri(uri)
    if configured is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = configured
