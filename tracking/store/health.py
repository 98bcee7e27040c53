"""Whether the tracking server is there: failures told apart, a remembered probe, retries.

An unreachable server (connection errors, timeouts, 5xx, a proxy's bare 404) is an outage:
runs go to the local fallback store (``tracking.store.offline_store``). Wrong credentials are
different: they are refused at once with a message naming the server and the environment
variables (``TrackingAuthError``), never silently logged elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from typing import Callable, TypeVar

from mlflow.exceptions import MlflowException

from tracking.store import uris

# A health check must answer in seconds; MLflow's own defaults (7 retries, 120 s timeout)
# would stall a training process for minutes before it could fall back. Not less than
# ~15 s: basic-auth's first password check is a slow hash on a busy server.
HEALTH_TIMEOUT_ENV = "WORKBENCH_HEALTH_TIMEOUT"
HEALTH_CACHE_SECONDS = 20.0
CREDENTIAL_ENV = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")

T = TypeVar("T")
_health: dict[str, tuple[float, str]] = {}  # uri#credentials -> (checked at, "up" | why it is away)
_accounts: dict[str, str] = {}  # uri#credentials -> the account the server authenticated ("": none)
# MLflow's basic-auth app: who these credentials are
CURRENT_USER_PATH = "/api/2.0/mlflow/users/current"


class TrackingAuthError(RuntimeError):
    """The server refused our credentials. Its message is written for the user: every command prints it as is."""


def exception_chain(err: BaseException):
    """``err``, then every cause and context it was raised from, once each."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _http_failure(err: BaseException) -> int | None:
    """0 for a connection-level failure, the HTTP status for a server or proxy error, else None."""
    import requests

    for e in exception_chain(err):
        if isinstance(e, (requests.exceptions.RequestException, ConnectionError, TimeoutError)):
            return 0
        if isinstance(e, MlflowException):
            message = str(e.message)
            if (
                message.startswith("API request to")
                and "failed with" in message
                and "error code" not in message
            ):
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
    for e in exception_chain(err):
        if isinstance(e, (requests.exceptions.RequestException, ConnectionError, TimeoutError)):
            text = type(e).__name__
            break
    for hint in (
        "Connection refused",
        "timed out",
        "Name or service not known",
        "Connection reset",
    ):
        if hint in str(err):
            return f"{text}: {hint.lower()}"
    return uris.redact_uri(text)[:200]


def raise_if_auth_failure(uri: str, err: BaseException) -> None:
    """Refused credentials at the start of a run are an error to fix, never a reason to go offline."""
    status = _http_failure(err)
    if status in (401, 403):
        raise auth_error(uri, status) from None


def auth_error(uri: str, status: int) -> TrackingAuthError:
    """401: the credentials are wrong (set others). 403: they are fine, the account may not do this."""
    if status == 403:
        # The server knew the account (a wrong password is 401): new credentials fix nothing.
        return TrackingAuthError(
            f"MLflow tracking server {uris.redact_uri(uri)} accepted the credentials but does not let "
            "this account do that (HTTP 403); new credentials change nothing: where it is another "
            "account's experiment, that account or the server's admin grants access (docs/server.md, section 2)"
        )
    return TrackingAuthError(
        f"MLflow tracking server {uris.redact_uri(uri)} refused the credentials (HTTP {status}). Set MLFLOW_TRACKING_USERNAME "
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
        response = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "GET",
            params={"max_results": 1},
            max_retries=0,
            timeout=timeout,
        )
    except Exception as err:  # connection refused, DNS, TLS, timeout: all mean "not now"
        return describe_failure(err)
    if response.status_code in (401, 403):
        raise auth_error(uri, response.status_code)
    if response.status_code == 200:
        return "up"
    return f"HTTP {response.status_code} from {uris.redact_uri(uri)}"


def server_account(uri: str) -> str | None:
    """The account the server authenticated these credentials as; "" on a server without accounts.

    Asked of the server (``GET users/current`` of MLflow's basic-auth app, once per server and
    credentials), never read from a tag a client sets (``mlflow.user``). A server without that
    endpoint (no auth app, HTTP 404) has no accounts, unless credentials are set: an older
    basic-auth app authenticated them on every call, so they name the account. None: the
    server cannot be asked now (away).

    Raises:
        TrackingAuthError: The server refused the credentials (401).
    """
    key = _health_key(uri)
    if key in _accounts:
        return _accounts[key]
    if known_down(uri):
        return None
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    creds = get_default_host_creds(uri)
    timeout = float(os.environ.get(HEALTH_TIMEOUT_ENV, 15))
    try:
        response = http_request(creds, CURRENT_USER_PATH, "GET", max_retries=0, timeout=timeout)
    except Exception:  # noqa: BLE001 - away now: asked again next time (the probe decides outages)
        return None
    if response.status_code == 401:
        raise auth_error(uri, 401)
    if response.status_code == 200:
        account = str(response.json().get("user", {}).get("username", ""))
    elif response.status_code == 404:
        account = creds.username or ""
    else:
        return None
    _accounts[key] = account
    return account


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


def forget_probes() -> None:
    """Drop remembered probe results (``offline_store.forget_health`` drops the warnings too)."""
    _health.clear()
    _accounts.clear()


def with_retries(
    fn: Callable[[], T],
    what: str,
    attempts: int = 4,
    first_delay: float = 2.0,
    retry_if: Callable[[BaseException], bool] = is_unreachable,
) -> T:
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
            print(
                f"retrying {what} in {delay:.0f} s (attempt {attempt} of {attempts} failed: "
                f"{uris.redact_uri(str(err))[:200]})",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")
