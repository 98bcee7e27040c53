"""Users and grants of the basic-auth tracking server, through its REST API, as the admin.

What MLflow 3.17's basic-auth lets a user do on one experiment (its permission table,
``mlflow/server/auth/permissions.py``; which request needs which capability,
``BEFORE_REQUEST_HANDLERS`` in ``mlflow/server/auth/__init__.py``):

- READ (and USE, which adds nothing on experiments and runs): see the experiment, its
  runs, metrics and artifacts.
- EDIT: also create runs in it and change *any* run in it (metrics, params, tags,
  artifacts, status: another user's FINISHED run can be set to FAILED), rename the
  experiment and change its tags.
- MANAGE: also delete and restore runs and the experiment, and grant others.
- DENY: nothing, not even reading; it wins over the server's default permission.

A grant never takes a user below the server's default permission (except DENY): MLflow
floors every positive grant at it. Removing a grant (``revoke``) falls back to that
default. MLflow keeps a user's grants on a role of its own (``__user_<id>__``); changing
a grant updates its row there in place, so the user never drops to the default meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Iterator

from tracking.server.server_config import (
    ADMIN_PASSWORD_ENV,
    ADMIN_USER_ENV,
    MIN_PASSWORD,
    ServerConfigError,
)
from tracking.store import health, uris
from tracking.store.uris import redact_uri

# What MLflow 3.17 accepts as a grant on one experiment (RESOURCE_GRANTABLE_PERMISSIONS;
# NO_PERMISSIONS is refused there): weakest first.
GRANT_PERMISSIONS = ("READ", "USE", "EDIT", "MANAGE", "DENY")
_OWN_ROLE = re.compile(r"__user_(\d+)__")


def edit_warning(username: str, experiment: str) -> str:
    """What EDIT allows beyond logging one's own runs: said whenever it is granted."""
    return (
        f"note: EDIT lets {username} rename experiment {experiment!r} and change any run in it, other users' "
        "finished runs included (metrics, tags, artifacts, status); only MANAGE deletes runs or the experiment"
    )


@dataclass(frozen=True)
class Grant:
    """The outcome of ``grant`` or ``revoke`` on one experiment."""

    experiment_id: str
    before: str | None  # the user's own grant before the change (None: none)
    after: str | None  # ... and after it (None: removed)
    effective: str | None = None  # what the user may do now, default permission included (revoke)


@contextlib.contextmanager
def _credentials(user: str, password: str):
    """MLflow's auth client reads credentials from the environment; lend it the admin's for one call."""
    keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict(zip(keys, (user, password))))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _refused(err, tracking_uri: str, what: str) -> ServerConfigError:
    """One line for a failed admin call: never MLflow's raw message (it may quote SQL and a password hash)."""
    where = redact_uri(tracking_uri)
    if health.is_unreachable(err):  # connection refused, timeouts, 5xx of a proxy; never 401 / 403
        return ServerConfigError(
            f"could not {what}: {where} unreachable ({health.describe_failure(err)})"
        )
    status = err.get_http_status_code()
    if status == 401:
        return ServerConfigError(
            f"{where} refused the admin credentials ({ADMIN_USER_ENV} / {ADMIN_PASSWORD_ENV})"
        )
    if status == 403:  # logged in, but not allowed: the account is no admin
        return ServerConfigError(
            f"could not {what}: {where} answered HTTP 403 (forbidden): the account in "
            f"{ADMIN_USER_ENV} logged in but is not the server's admin"
        )
    return ServerConfigError(f"could not {what}: {err.error_code} (HTTP {status}) from {where}")


@contextlib.contextmanager
def _admin_client(tracking_uri: str, admin_user: str, admin_password: str, what: str) -> Iterator:
    """The basic-auth client as the admin; MLflow errors inside become one ``ServerConfigError`` line."""
    from mlflow.exceptions import MlflowException
    from mlflow.server import get_app_client

    uris.apply_http_defaults()  # a dead server is one line after seconds, not minutes of MLflow's retries
    with _credentials(admin_user, admin_password):
        try:
            yield get_app_client("basic-auth", tracking_uri=tracking_uri)
        except MlflowException as err:
            raise _refused(err, tracking_uri, what) from None


def _user_exists(client, username: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_user(username)
        return True
    except MlflowException as err:
        if err.get_http_status_code() == 404:
            return False
        raise


def _require_user(client, tracking_uri: str, username: str) -> None:
    if not _user_exists(client, username):
        raise ServerConfigError(
            f"no user {username!r} on {redact_uri(tracking_uri)}; add it with "
            "`workbench server add-user`"
        )


def _experiment_id(
    tracking_uri: str, experiment: str, client=None, acting: str | None = None
) -> str:
    """The id of an experiment given by name or id (asked as the admin).

    An experiment the acting account may not read (HTTP 403: it is no admin and holds DENY,
    or the default permission lets it see nothing) is named as that, not as missing.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    tracking, denied = MlflowClient(tracking_uri), False
    try:
        exp = tracking.get_experiment_by_name(experiment)
    except MlflowException as err:
        if err.get_http_status_code() != 403:
            raise
        exp, denied = None, True
    if exp is None and experiment.isdigit():
        try:
            exp = tracking.get_experiment(experiment)
        except MlflowException as err:
            denied = denied or err.get_http_status_code() == 403
    if exp is None and denied and client is not None and acting:
        raise ServerConfigError(_cannot_see(client, tracking_uri, experiment, acting))
    if exp is None:
        raise ServerConfigError(f"no experiment {experiment!r} on {redact_uri(tracking_uri)}")
    return exp.experiment_id


def _cannot_see(client, tracking_uri: str, experiment: str, acting: str) -> str:
    """Why the acting account was refused an experiment: what it is and what it holds there."""
    from mlflow.exceptions import MlflowException

    what, holds = "", ""
    with contextlib.suppress(MlflowException, AttributeError):
        what = "" if client.get_user(acting).is_admin else " is not an admin of this server and"
    if experiment.isdigit():  # an account may read its own permission on an id
        with contextlib.suppress(MlflowException, AttributeError):
            holds = f" holds {client.get_user_permission(acting, 'experiment', experiment).permission} there"
    reason = f"{acting!r} ({ADMIN_USER_ENV}){what}{holds or ' may not read it'}"
    return (
        f"experiment {experiment!r} on {redact_uri(tracking_uri)}: the server refused to show it (HTTP 403): "
        f"{reason}; grant and revoke run as the server's admin account ({ADMIN_USER_ENV} / {ADMIN_PASSWORD_ENV})"
    )


def _current_grant(client, tracking_uri: str, username: str, experiment: str):
    """``(experiment id, the user's own grant row on it or None)``; an unknown user or experiment is an error."""
    _require_user(client, tracking_uri, username)
    exp_id = _experiment_id(
        tracking_uri, experiment, client, os.environ.get("MLFLOW_TRACKING_USERNAME")
    )
    return exp_id, _own_grant(client, username, exp_id)


def _own_grant(client, username: str, experiment_id: str):
    """The row of ``username``'s own grant on the experiment (a RolePermission), or None."""
    user_id = str(client.get_user(username).id)
    for role in client.list_user_roles(username):
        found = _OWN_ROLE.fullmatch(role.name or "")
        if found and found.group(1) == user_id:
            for row in client.list_role_permissions(role.id):
                if row.resource_type == "experiment" and row.resource_pattern == experiment_id:
                    return row
    return None


def check_permission(permission: str) -> str:
    """``permission`` upper-cased if MLflow accepts it as a grant.

    Raises:
        ServerConfigError: Naming the value, what is accepted, and how to take a grant back.
    """
    value = permission.strip().upper()
    if value not in GRANT_PERMISSIONS:
        hint = (
            "; to take a grant back use `workbench server revoke USER EXPERIMENT`, to shut a user out DENY"
            if value in ("NO_PERMISSIONS", "NONE", "REVOKE")
            else ""
        )
        raise ServerConfigError(
            f"{permission!r} is not a permission MLflow grants on an experiment "
            f"({', '.join(GRANT_PERMISSIONS)}){hint}"
        )
    return value


def add_user(
    tracking_uri: str,
    username: str,
    password: str,
    admin_user: str,
    admin_password: str,
    make_admin: bool = False,
) -> None:
    """Create a basic-auth user (as the admin).

    Raises:
        ServerConfigError: A password MLflow would refuse, or the user exists already.
    """
    if len(password) < MIN_PASSWORD:
        raise ServerConfigError(
            f"the password of {username!r} is shorter than {MIN_PASSWORD} characters"
        )
    with _admin_client(
        tracking_uri, admin_user, admin_password, f"create user {username!r}"
    ) as client:
        if _user_exists(client, username):
            raise ServerConfigError(
                f"user {username!r} already exists on {redact_uri(tracking_uri)}; nothing changed"
            )
        client.create_user(username, password)
        if make_admin:
            client.update_user_admin(username, True)


def grant(
    tracking_uri: str,
    username: str,
    experiment: str,
    permission: str,
    admin_user: str,
    admin_password: str,
) -> Grant:
    """Give ``username`` ``permission`` on one experiment (by name or id), or change the grant it has.

    Raises:
        ServerConfigError: A permission MLflow refuses, an unknown user or experiment, refused
            admin credentials, or an unreachable server.
    """
    permission = check_permission(permission)
    with _admin_client(
        tracking_uri,
        admin_user,
        admin_password,
        f"grant {permission} on {experiment!r} to {username!r}",
    ) as client:
        exp_id, row = _current_grant(client, tracking_uri, username, experiment)
        if row is None:
            client.grant_user_permission(username, "experiment", exp_id, permission)
        elif row.permission != permission:
            client.update_role_permission(row.id, permission)
    return Grant(exp_id, row.permission if row else None, permission)


def revoke(
    tracking_uri: str, username: str, experiment: str, admin_user: str, admin_password: str
) -> Grant:
    """Remove ``username``'s own grant on one experiment; it falls back to the server's default permission.

    Raises:
        ServerConfigError: No such grant (nothing changed), an unknown user or experiment,
            refused admin credentials, or an unreachable server.
    """
    with _admin_client(
        tracking_uri,
        admin_user,
        admin_password,
        f"revoke the grant of {username!r} on {experiment!r}",
    ) as client:
        exp_id, row = _current_grant(client, tracking_uri, username, experiment)
        if row is None:
            raise ServerConfigError(
                f"{username!r} holds no grant on experiment {experiment!r} (id {exp_id}) on "
                f"{redact_uri(tracking_uri)}; nothing changed"
            )
        client.revoke_user_permission(username, "experiment", exp_id)
        now = client.get_user_permission(username, "experiment", exp_id).permission
    return Grant(exp_id, row.permission, None, now)
