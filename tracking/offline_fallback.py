"""Where runs go when the tracking server is away: health checks, the local fallback store, redaction.

A training run must never die because the tracking server died. The configured store is
MLFLOW_TRACKING_URI (credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, as
everywhere in MLflow). When it is an HTTP server that cannot be reached, runs go to a local
SQLite store instead (``$WORKBENCH_OFFLINE_DIR``, default ``./mlflow-offline``, with its
artifacts beside it) and ``workbench sync`` copies them to the server later.

Wrong credentials are different from an outage: they are refused at once with a message
naming the server and the environment variables, never silently logged elsewhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Callable, TypeVar

import click
import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking import redact
from tracking.store_lock import ensure_store

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
OFFLINE_DIR_ENV = "WORKBENCH_OFFLINE_DIR"
DEFAULT_OFFLINE_DIR = "mlflow-offline"
# A health check must answer in seconds; MLflow's own defaults (7 retries, 120 s timeout)
# would stall a training process for minutes before it could fall back. Not less than
# ~15 s: basic-auth's first password check is a slow hash on a busy server.
HEALTH_TIMEOUT_ENV = "WORKBENCH_HEALTH_TIMEOUT"
HEALTH_CACHE_SECONDS = 20.0
# Applied only when the user has not set them: short enough that a dead server costs a run
# seconds, long enough to ride out a server restart or a slow upload.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")

# MLflow 3's UI opens an experiment on its GenAI overview unless the experiment says it
# holds model training (the values of the UI's ExperimentKind).
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"

T = TypeVar("T")
_health: dict[str, tuple[float, str]] = {}  # uri#credentials -> (checked at, "up" | why it is away)
_warned: set[str] = set()


class TrackingAuthError(click.ClickException):
    """The server refused our credentials. A ClickException so every command prints it plainly."""


# ---------------------------------------------------------------- URIs and secrets


def tracking_uri() -> str:
    """The configured store: MLFLOW_TRACKING_URI or the embedded SQLite default."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def redact_uri(uri: str) -> str:
    """``https://user:pw@host/x`` -> ``https://***@host/x``: safe to print, tag or log (``tracking.redact``)."""
    return redact.redact_url(uri)


def scrub(value) -> str:
    """A param or tag value with URL userinfo, secret options and secret env values replaced by ***."""
    return redact.redact_text(value)


def apply_http_defaults() -> None:
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


# ---------------------------------------------------------------- the local fallback store


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
                client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return exp.experiment_id
    location = None
    if client.tracking_uri == fallback_uri():
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80] or "experiment"
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        location = (offline_dir() / "artifacts" / f"{safe}-{digest}").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location,
                                        tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
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


# ---------------------------------------------------------------- errors and health


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _http_failure(err: BaseException) -> int | None:
    """0 for a connection-level failure, the HTTP status for a server or proxy error, else None."""
    import requests

    for e in _chain(err):
        if isinstance(e, (requests.exceptions.RequestException, ConnectionError, TimeoutError)):
            return 0
        if isinstance(e, MlflowException):
            message = str(e.message)
            if message.startswith("API request to") and "failed with" in message and "error code" not in message:
                return 0  # MLflow's wrapper around a requests exception, which it does not chain
            found = re.search(r"failed with error code (\d{3})", message)
            status = int(found.group(1)) if found else e.get_http_status_code()
            # MLflow's own errors come as JSON (RestException); a bare status with a text
            # body is the proxy, the tunnel or the auth layer in front of the server talking.
            if "error code" in message and status in (401, 403, 404, 408, 429, 500, 502, 503, 504):
                return status
    return None


def is_unreachable(err: BaseException) -> bool:
    """Whether ``err`` means the server (or the tunnel in front of it) is away, not that we erred.

    Connection errors, timeouts, 5xx and a proxy's bare 404 count; refused credentials do
    not (``is_auth_failure``): retrying or waiting does not fix those.
    """
    return _http_failure(err) not in (None, 401, 403)


def is_auth_failure(err: BaseException) -> bool:
    return _http_failure(err) in (401, 403)


def is_permission_denied(err: BaseException) -> bool:
    """HTTP 403: the server knows the account and will not let it do this (e.g. write to another's experiment)."""
    return _http_failure(err) == 403


def describe_failure(err: BaseException) -> str:
    """A short, credential-free reason for a warning line."""
    import requests

    status = _http_failure(err)
    if status:
        return f"HTTP {status}"
    text = str(err)
    for e in _chain(err):
        if isinstance(e, (requests.exceptions.RequestException, ConnectionError, TimeoutError)):
            text = type(e).__name__
            break
    for hint in ("Connection refused", "timed out", "Name or service not known", "Connection reset"):
        if hint in str(err):
            return f"{text}: {hint.lower()}"
    return redact_uri(text)[:200]


def raise_if_auth_failure(uri: str, err: BaseException) -> None:
    """Refused credentials at the start of a run are an error to fix, never a reason to go offline."""
    status = _http_failure(err)
    if status in (401, 403):
        raise auth_error(uri, status) from None


def auth_error(uri: str, status: int) -> TrackingAuthError:
    what = "refused the credentials" if status == 401 else "denied this user access"
    return TrackingAuthError(
        f"MLflow tracking server {redact_uri(uri)} {what} (HTTP {status}). Set MLFLOW_TRACKING_USERNAME "
        f"and MLFLOW_TRACKING_PASSWORD to an account on that server (ask its admin: `workbench server add-user`)."
    )


def check_server(uri: str, timeout: float | None = None) -> str:
    """Probe ``uri`` with one authenticated request: "up", or why it is unreachable.

    Raises:
        TrackingAuthError: The server answered 401 or 403.
    """
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    timeout = timeout or float(os.environ.get(HEALTH_TIMEOUT_ENV, 15))
    try:
        # An authenticated endpoint (``/health`` is open even with basic-auth) that no
        # permission setting can forbid: search answers with what the user may read.
        response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search", "GET",
                                params={"max_results": 1}, max_retries=0, timeout=timeout)
    except Exception as err:  # connection refused, DNS, TLS, timeout: all mean "not now"
        return describe_failure(err)
    if response.status_code in (401, 403):
        raise auth_error(uri, response.status_code)
    if response.status_code == 200:
        return "up"
    return f"HTTP {response.status_code} from {redact_uri(uri)}"


def _health_key(uri: str) -> str:
    """A probe result holds for one server *and* one set of credentials."""
    creds = "|".join(os.environ.get(k, "") for k in CREDENTIAL_ENV)
    return f"{uri}#{hashlib.sha256(creds.encode()).hexdigest()[:16]}"


def server_state(uri: str, refresh: bool = False) -> str:
    """``check_server`` with a short memory, so one command does not probe before every call."""
    now, key = time.monotonic(), _health_key(uri)
    cached = _health.get(key)
    if cached and not refresh and now - cached[0] < HEALTH_CACHE_SECONDS:
        return cached[1]
    state = check_server(uri)
    _health[key] = (now, state)
    return state


def known_down(uri: str) -> str | None:
    """Why ``uri`` was found away in the last few seconds, if it was: no need to ask it again."""
    cached = _health.get(_health_key(uri))
    if cached and cached[1] != "up" and time.monotonic() - cached[0] < HEALTH_CACHE_SECONDS:
        return cached[1]
    return None


def mark_down(uri: str, reason: str) -> None:
    _health[_health_key(uri)] = (time.monotonic(), reason)


def forget_health() -> None:
    """Drop remembered probe results (tests restart servers on the same address)."""
    _health.clear()
    _warned.clear()


def warn_offline(uri: str, reason: str, what: str = "runs") -> None:
    """One line per server and process: where the runs go instead and how they get back."""
    if uri in _warned:
        return
    _warned.add(uri)
    click.echo(
        f"WARNING: tracking server {redact_uri(uri)} unreachable ({reason}); {what} go to the local store "
        f"{fallback_uri()}. Copy them to the server later with `workbench sync`.", err=True,
    )


def active_store_uri() -> str:
    """The store new runs should go to now: the configured one, or the fallback while a server is away."""
    uri = tracking_uri()
    if not is_remote(uri):
        return uri
    apply_http_defaults()
    state = server_state(uri)
    if state == "up":
        return uri
    warn_offline(uri, state)
    return fallback_uri()


# ---------------------------------------------------------------- retries


def with_retries(fn: Callable[[], T], what: str, attempts: int = 4, first_delay: float = 2.0,
                 retry_if: Callable[[BaseException], bool] = is_unreachable) -> T:
    """Call ``fn`` until it succeeds, sleeping 2, 4, 8 ... seconds between tries of a retryable error.

    Large artifact uploads need this on top of MLflow's own HTTP retries: those cannot
    rewind a half-sent file stream, so a dropped connection mid-upload fails the call.
    """
    delay = first_delay
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:
            if attempt == attempts or not retry_if(err):
                raise
            click.echo(f"retrying {what} in {delay:.0f} s (attempt {attempt} of {attempts} failed: "
                       f"{redact_uri(str(err))[:200]})", err=True)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


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


def go_offline_or_raise(uri: str, err: BaseException) -> None:
    """After a failed call to ``uri``: re-raise unless the server is unreachable, else record and warn.

    Wrong credentials and ordinary errors propagate; only an outage sends runs offline.
    """
    raise_if_auth_failure(uri, err)
    if not is_unreachable(err):
        raise err
    mark_down(uri, describe_failure(err))
    warn_offline(uri, describe_failure(err))
