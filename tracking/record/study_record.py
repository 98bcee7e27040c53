"""Which experiments hold a study's record: found by what it is, never by a name another account can take.

A study's record is its parent runs (tags ``protocol_name``, ``protocol_hash``, ``parent``) and
their cells. It is found by those tags, in the experiments this account owns, whatever they are
called: a renamed experiment is still the study's record, and an experiment of the protocol's
name is not, unless this account owns it. Any account of a server may create an experiment of
any free name and copy runs into it with any tags (``mlflow.user`` included: MLflow stores the
client's value as the run's user); what it cannot do is give itself a grant on another
account's experiment. So "owns" is what a stranger cannot forge:

- on a tracking server with MLflow's basic-auth app, this account holds an explicit grant of
  EDIT or MANAGE on the experiment (``users/current/permissions``: its creator gets MANAGE; an
  owner or the admin grants a collaborator EDIT), not the default permission every account
  has (READ). The account is the one the server authenticated
  (``tracking.store.health.server_account``), not a name a client sets;
- on a store without accounts (a local SQLite file, a server without the auth app),
  every experiment is the local user's.

Every command looks a study up here: ``status``, ``ablate``, ``report``, ``figures`` and every
acting kind (intervene, attribute, transfer) alike. Where another account holds the protocol's
name, one line says so (``tell``) and the record is created under ``protocol@account`` instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tracking.record.schema import PROTOCOL_NAME, parent_filter, tag_is
from tracking.store import health, uris

_owners: dict[tuple[str, str, str], bool] = {}  # (uri, account, experiment id) -> holds it
# MLflow's basic-auth app: one's own grants
GRANTS_PATH = "/api/3.0/mlflow/users/current/permissions"
TRUSTED = ("EDIT", "MANAGE")
_told: set[str] = set()  # lines said once per process


@dataclass(frozen=True)
class StudyRecord:
    """Where a protocol's record is, as this account may trust it.

    Attributes:
        protocol_name: The protocol.
        experiments: ``{experiment id: name}`` of this account's experiments holding a parent
            run of the protocol (normally one).
        squatted: ``(id, name)`` of an experiment named after the protocol that another account
            owns (never read), or None.
    """

    protocol_name: str
    experiments: dict[str, str]
    squatted: tuple[str, str] | None = None


def find_record(client: MlflowClient, protocol_name: str) -> StudyRecord:
    """The experiments this account owns that hold the protocol's parent runs; reads only."""
    named = client.get_experiment_by_name(protocol_name)
    squatted = None
    if named is not None and named.lifecycle_stage == "active":
        if not owns(client, named.experiment_id):
            squatted = (named.experiment_id, named.name)
        elif client.search_runs(
            [named.experiment_id], tag_is(PROTOCOL_NAME, protocol_name), max_results=1
        ):  # the usual case, two queries; a renamed copy beside it is not looked for
            return StudyRecord(protocol_name, {named.experiment_id: named.name})
    experiments = {e.experiment_id: e.name for e in client.search_experiments(max_results=50000)}
    ids, found = list(experiments), {}
    for i in range(0, len(ids), 100):  # search_runs takes at most 100 experiments at once
        for run in client.search_runs(
            ids[i : i + 100], parent_filter(protocol_name), max_results=1000
        ):
            found[run.info.experiment_id] = experiments[run.info.experiment_id]
    owned = {i: name for i, name in sorted(found.items()) if owns(client, i)}
    return StudyRecord(protocol_name, owned, squatted)


def owns(client: MlflowClient, experiment_id: str) -> bool:
    """Whether this account holds the experiment: an explicit grant of EDIT or MANAGE (always, on a
    store without accounts). The server's default permission (READ) is no grant."""
    uri = client.tracking_uri
    if not uris.is_remote(uri):
        return True  # a local store has no accounts: nobody else's experiment is in it
    account = health.server_account(uri)
    if account == "":
        return True  # a server without accounts
    if account is None:
        return False  # the server cannot be asked now: nothing is proven
    key = (uri, account, experiment_id)
    if not _owners.get(key):  # a grant given meanwhile counts at once; one held is kept
        _owners[key] = _granted(uri, account, experiment_id)
    return _owners[key]


def _granted(uri: str, account: str, experiment_id: str) -> bool:
    """This account's own grants (``users/current/permissions``: its creator's MANAGE, an owner's
    or the admin's grant), never the default every account has; MANAGE resolved, on older servers."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(get_default_host_creds(uri), GRANTS_PATH, "GET", max_retries=0)
        if response.status_code == 404:  # an older server: no list of one's own grants
            return _holds_manage(uri, account, experiment_id)
        rows = response.json().get("permissions", []) if response.status_code == 200 else []
    except Exception:  # noqa: BLE001 - an answer that cannot be read proves nothing
        return False
    return any(
        row.get("resource_type") == "experiment"
        and row.get("resource_pattern") in (experiment_id, "*")
        and row.get("permission") in TRUSTED
        for row in rows
    )


def _holds_manage(uri: str, account: str, experiment_id: str) -> bool:
    from mlflow.server import get_app_client

    try:
        held = get_app_client("basic-auth", tracking_uri=uri).get_user_permission(
            account, "experiment", experiment_id
        )
    except MlflowException as err:
        return err.get_http_status_code() == 404  # an older server without the auth app
    except Exception:  # noqa: BLE001 - an answer that cannot be read proves no ownership
        return False
    return getattr(held, "permission", "") == "MANAGE"


def account_name(client: MlflowClient) -> str:
    """This account as the server knows it ("" on a store without accounts)."""
    uri = client.tracking_uri
    return (health.server_account(uri) or "") if uris.is_remote(uri) else ""


def own_name(client: MlflowClient, record: StudyRecord) -> str:
    """The name a new record is created under: the protocol's, or ``protocol@account`` when another
    account holds that name (found later by its runs' tags like any other).

    Raises:
        PermissionError: That name is another account's too.
    """
    if record.squatted is None:
        return record.protocol_name
    name = f"{record.protocol_name}@{account_name(client)}"
    taken = client.get_experiment_by_name(name)
    if taken is not None and not owns(client, taken.experiment_id):
        raise PermissionError(
            f"experiments {record.protocol_name!r} and {name!r} on {uris.redact_uri(client.tracking_uri)} "
            "both belong to another account: give your protocol another name"
        )
    return name


def squat_line(client: MlflowClient, record: StudyRecord, alternative: str | None = None) -> str:
    """One line: the protocol's name is another account's experiment, and where this study's record is."""
    exp_id, name = record.squatted or ("", "")
    where = f"experiment {name!r} (id {exp_id}) on {uris.redact_uri(client.tracking_uri)}"
    if record.experiments:
        mine = ", ".join(f"{n!r} (id {i})" for i, n in record.experiments.items())
        return f"{where} belongs to another account and is not read: this study's record is experiment {mine}"
    if alternative:
        return (
            f"{where} belongs to another account and is not read: this study's record is "
            f"experiment {alternative!r} (found by its runs' tags, whatever its name)"
        )
    return (
        f"{where} belongs to another account and is not read; no experiment of yours holds "
        f"protocol {record.protocol_name!r} (`workbench ablate` creates its record under another name)"
    )


def tell(line: str) -> None:
    """Say a line once per process (each command looks a study up several times)."""
    if line not in _told:
        _told.add(line)
        print(line, file=sys.stderr, flush=True)


def record_ids(protocol_name: str, client: MlflowClient | None = None) -> list[str]:
    """A reader's view: the ids of this account's experiments holding the protocol's record (maybe
    none), saying once where another account holds the protocol's name."""
    client = client or MlflowClient()
    record = find_record(client, protocol_name)
    if record.squatted:
        tell(squat_line(client, record))
    return list(record.experiments)
