"""Find-or-create-once on every store: which of the runs made at one moment for one thing is its run.

MLflow has no "create this run unless one exists" and no conditional write, and over its
REST API a client cannot lock anything. Two executions of one study started together both
find nothing and both create: a study's parent, a sweep's parent, a cell's first run. The
rules that make one of them *the* run live here, for parents and cells alike
(docs/study-record.md, "Two executions started together"):

- **A new run** (create, then resolve): every execution that found none creates its own
  candidate, waits ``settle_seconds`` and lists the candidates. The first of them by
  (start time, run id) (``ordered``) is the run: its creator goes on; every other
  withdraws its own (``withdraw``: its lease tags removed, ``superseded_by`` the winner,
  ended KILLED and deleted, so no deleted run stays RUNNING or looks held) and uses the
  first: a parent is shared, a cell is left to the execution training it.
- **An existing run continued** (a killed cell resumed in place, or continued in a new run):
  every execution writes its lease token on it, waits, and reads it back (``claim_existing``).
  The token found there is the one holder; the others leave the cell. A parent reopened by
  several executions at once is shared: they all renew the token left on it (``shared_token``).
- A cell's trainer looks once more right before its first step (``confirm_first``), so no
  two trainers ever write one ``run_dir``: a candidate that is not first by then withdraws
  and skips the cell.

Why the wait: a run's start time is taken by its client before the create request, so a
candidate that sorts first can become visible a moment after another execution listed the
candidates. Waiting longer than a create takes (and than the clocks of the hosts differ)
before listing lets every execution see the same first candidate. On a local SQLite store
the executions take turns under the store's file lock (``tracking.store.store_lock``): the list
is exact at once and the wait is 0.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable

from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record.lease import LeaseLost
from tracking.record.schema import (
    HOST_TAG,
    LEASE_PREFIX,
    PID_TAG,
    REASON_TAG,
    SUPERSEDED_TAG,
    TOKEN_TAG,
)
from tracking.store.store_lock import sqlite_path

SETTLE_ENV = "WORKBENCH_CLAIM_SETTLE_SECONDS"
# a create over HTTP takes well under a second, also on a loaded machine
DEFAULT_SETTLE_SECONDS = 2.0


class ClaimLost(LeaseLost):
    """Another execution's run is this cell's run: stop before training, nothing more is written."""

    def __init__(self, why: str, winner: str) -> None:
        super().__init__(why)
        self.winner = winner


def settle_seconds(uri: str) -> float:
    """How long a candidate waits before the candidates are listed: 0 where the store's lock serialises."""
    if sqlite_path(uri) is not None:
        return 0.0
    return float(os.environ.get(SETTLE_ENV) or DEFAULT_SETTLE_SECONDS)


def settle(client: MlflowClient) -> None:
    """The wait between writing a candidate (or a token) and reading who holds the thing."""
    time.sleep(settle_seconds(client.tracking_uri))


def ordered(runs: list[Run]) -> list[Run]:
    """Candidates first to last: the rule of which one is the run, for parents and cells alike."""
    return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def resolve_new(client: MlflowClient, mine: str, candidates: Callable[[], list[Run]]) -> Run:
    """The run among the candidates after the wait (``mine``: the one this execution just created)."""
    settle(client)
    found = candidates()
    if not any(r.info.run_id == mine for r in found):  # a search a moment behind its own create
        found.append(client.get_run(mine))
    return ordered(found)[0]


def confirm_first(client: MlflowClient, mine: str, candidates: Callable[[], list[Run]]) -> None:
    """Raise ``ClaimLost`` unless ``mine`` is still the first candidate (the check before training)."""
    found = ordered(candidates())
    first = found[0].info.run_id if found else ""
    if first != mine:
        why = (
            f"another execution created this cell's run at the same moment (run {first}) and trains it"
            if first
            else f"run {mine} is no longer this cell's run"
        )
        raise ClaimLost(why, first)


def withdraw(client: MlflowClient, run_id: str, winner: str, why: str) -> None:
    """Take back a candidate that is not the run: no lease tag left, ``superseded_by`` the winner, KILLED, deleted."""
    with contextlib.suppress(Exception):
        for key in [k for k in client.get_run(run_id).data.tags if k.startswith(LEASE_PREFIX)]:
            with contextlib.suppress(Exception):  # one already gone is what was wanted
                client.delete_tag(run_id, key)
    # log_batch: MLflow retries an insert lost to another writer there (a reaper, say).
    client.log_batch(
        run_id,
        tags=[RunTag(REASON_TAG, why[:500]), *([RunTag(SUPERSEDED_TAG, winner)] if winner else [])],
    )
    client.set_terminated(run_id, "KILLED")  # a deleted run must not stay RUNNING
    client.delete_run(run_id)


def claim_existing(client: MlflowClient, run_id: str, lease: dict[str, str]) -> str | None:
    """Write this execution's lease on an existing run, wait, read it back: None when it is ours.

    Otherwise why not: the execution whose token is there now holds the run. The last token
    written wins, and after the wait every contender reads the same one.
    """
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in lease.items()])
    return holder_after_wait(client, run_id, lease[TOKEN_TAG])


def holder_after_wait(client: MlflowClient, run_id: str, token: str) -> str | None:
    """After the wait, None when ``token`` is still the one on ``run_id``; else who holds it."""
    settle(client)
    return _other_holder(client.get_run(run_id).data.tags, run_id, token)


def shared_token(client: MlflowClient, run_id: str, token: str) -> str:
    """The lease token of a shared run (a parent) after the wait: executions that reopened it
    at the same moment each wrote their own, and all of them renew the one left on it."""
    settle(client)
    return client.get_run(run_id).data.tags.get(TOKEN_TAG) or token


def confirm_holder(client: MlflowClient, run_id: str, token: str) -> None:
    """Raise ``ClaimLost`` when another execution's token is on ``run_id`` now (the check before training)."""
    why = _other_holder(client.get_run(run_id).data.tags, run_id, token)
    if why is not None:
        raise ClaimLost(why, "")


def _other_holder(tags: dict, run_id: str, token: str) -> str | None:
    if tags.get(TOKEN_TAG) == token:
        return None
    return (
        f"another execution took run {run_id} over at the same moment "
        f"({tags.get(HOST_TAG, '?')}/{tags.get(PID_TAG, '?')})"
    )
