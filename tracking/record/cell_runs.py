"""A cell's run, found by its run key or created once, and held under this execution's lease.

``open_keyed_run`` finds the run of a key in whichever store it belongs (the server, or the
local fallback store while it is not synced) or creates it once (``tracking.record.create_once``):
finished (nothing to do), held by a live execution elsewhere (BUSY: leave it), continued in
place when its last holder cannot write again, or continued in a new run with the same key
when it may (the old one fenced and closed ``superseded_by``). ``open_leased_run`` is what every
study kind opens its cells with: the same, under a new lease token of this execution, renewed
by the heartbeat from then on; ``end_held_run`` releases the lease and ends the run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

from mlflow.entities import Run, RunTag
from mlflow.tracking import MlflowClient

from tracking.record import create_once
from tracking.record.lease import HEARTBEATS, is_mine, lease_state, lease_tags, possible_writer
from tracking.record.lease_rule import new_token
from tracking.record.schema import (
    CONTINUES_TAG,
    FINISHED,
    LEASE_TAGS,
    PARENT_RUN_ID,
    REASON_TAG,
    RELEASED_TAG,
    RUN_KEY,
    RUNNING,
    SUPERSEDED_TAG,
    TOKEN_TAG,
    USER,
    tag_is,
)
from tracking.record.sink import SYNC_SYNCED, RunSink, log_batch, store_for
from tracking.store import offline_store, uris
from tracking.store.health import is_unreachable
from tracking.store.session import run_user
from tracking.store.store_lock import store_lock
from workbench.code_history import older_names


@dataclass
class KeyedRun:
    """The run of a run key: a sink to log through, and the status it had when found."""

    sink: RunSink | None
    run_id: str
    status: str | None  # None: created now; "BUSY": RUNNING under a live lease of another execution
    metrics: dict = field(default_factory=dict)
    why: str = ""  # for BUSY: who holds it
    previous_status: str | None = None
    # the run this one continues because its holder may still write to it
    continues: str | None = None
    # The look once more before the first training step (``tracking.record.create_once``): raises
    # ``ClaimLost`` (or ``LeaseLost``) when another execution's run is the cell's after all.
    confirm: Callable[[], None] | None = None
    token: str = ""  # the lease token this execution holds the run with (``open_leased_run``)


def _candidates(client: MlflowClient, experiment_id: str, key: str) -> list[Run]:
    """The runs that may be a cell's run: every run of its key not closed as superseded."""
    runs = client.search_runs([experiment_id], filter_string=tag_is(RUN_KEY, key), max_results=50)
    return [r for r in runs if SUPERSEDED_TAG not in r.data.tags]


def _find_by_key(
    client: MlflowClient, experiment_id: str, key: str, unsynced: bool = False
) -> Run | None:
    runs = client.search_runs(
        [experiment_id],
        filter_string=tag_is(RUN_KEY, key),
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    if unsynced:  # a synced run is on the server too, where the search found (or will find) it
        runs = [r for r in runs if SYNC_SYNCED not in r.data.tags]
    return runs[0] if runs else None


def same_code_key(experiment: str, key_for: Callable[[str], str], fingerprint: str) -> str:
    """A cell's run key ``key_for(fingerprint)``, or the key it had under an older fingerprint of the
    same code (``workbench.code_history``) when a FINISHED run holds that one: such a cell is done.

    Looked up in the tracking store only (the server, or the local store); a cell whose old run is
    not finished there is keyed, and run, under the current fingerprint. With the server away the
    current key is used: ``open_keyed_run`` then continues the cell in the local fallback store,
    as it does for any cell during an outage.
    """
    current = key_for(fingerprint)
    older = [key_for(old) for old in older_names(fingerprint)]
    if not older:
        return current
    client = MlflowClient()
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return current
        for key in older:
            run = _find_by_key(client, exp.experiment_id, key)
            if run is not None and run.info.status == FINISHED:
                return key
    except Exception as err:  # noqa: BLE001 - only an unreachable server is a reason to go on
        if not is_unreachable(err):
            raise
    return current


def open_keyed_run(
    experiment: str, key: str, tags: dict, parent_run_id: str | None = None, take_over: bool = False
) -> KeyedRun:
    """Find the run of ``key`` or create it, in whichever store it belongs; never two runs for one key.

    A RUNNING run held by a live execution is returned as BUSY, unless ``take_over`` (a
    queue that found that execution's lease expired hands the cell on).
    A run with this key that exists only in the local fallback store (not synced yet)
    continues there even when the server is back: one run, one timeline, merged by
    ``workbench sync``. A FINISHED run is returned without a sink (nothing to do).
    A new run belongs to ``run_user()``: the account logged in to the server, if any.
    """
    tags = {**tags, USER: run_user()}
    # Two executions reaching the same cell at once on a local store: one run, not two.
    with store_lock(store_for(parent_run_id)):
        return _find_or_create_keyed(experiment, key, tags, parent_run_id, take_over)


def _find_or_create_keyed(
    experiment: str, key: str, tags: dict, parent_run_id: str | None, take_over: bool
) -> KeyedRun:
    if uris.is_remote(uris.tracking_uri()) and offline_store.fallback_exists():
        found = _find_in_fallback(experiment, key, unsynced=True)
        if found is not None:
            return _keyed(
                found, offline_store.fallback_uri(), experiment, tags, parent_run_id, take_over
            )
    uri = store_for(parent_run_id)
    if uri != offline_store.fallback_uri():
        client = MlflowClient(uri)
        try:
            exp_id = (
                client.get_run(parent_run_id).info.experiment_id
                if parent_run_id
                else offline_store.ensure_experiment(client, experiment)
            )
            found = _find_by_key(client, exp_id, key)
        except Exception as err:
            offline_store.go_offline_or_raise(uri, err)
            uri = offline_store.fallback_uri()
        else:
            if found is not None:
                return _keyed(found, uri, experiment, tags, parent_run_id, take_over)
            sink = RunSink.create(
                experiment, {RUN_KEY: key, **tags}, parent_run_id, uri=uri, experiment_id=exp_id
            )
            return (
                KeyedRun(sink, sink.run_id, None)
                if sink.offline
                else _first_of_new(client, sink, exp_id, key)
            )
    found = _find_in_fallback(experiment, key)
    if found is not None:
        return _keyed(found, uri, experiment, tags, parent_run_id, take_over)
    sink = RunSink.create(experiment, {RUN_KEY: key, **tags}, parent_run_id, uri=uri)
    return KeyedRun(sink, sink.run_id, None)


def _first_of_new(client: MlflowClient, sink: RunSink, exp_id: str, key: str) -> KeyedRun:
    """The cell's new run, or the one another execution created at the same moment (``tracking.record.create_once``)."""
    candidates = lambda: _candidates(client, exp_id, key)  # noqa: E731
    first = create_once.resolve_new(client, sink.run_id, candidates)
    if first.info.run_id == sink.run_id:
        return KeyedRun(
            sink,
            sink.run_id,
            None,
            confirm=lambda: create_once.confirm_first(client, sink.run_id, candidates),
        )
    why = "another execution created its run at the same moment and trains it"
    create_once.withdraw(client, sink.run_id, first.info.run_id, why)
    status = FINISHED if first.info.status == FINISHED else "BUSY"
    return KeyedRun(None, first.info.run_id, status, dict(first.data.metrics), why)


def _find_in_fallback(experiment: str, key: str, unsynced: bool = False) -> Run | None:
    client = offline_store.fallback_client()
    exp = client.get_experiment_by_name(experiment)
    return _find_by_key(client, exp.experiment_id, key, unsynced) if exp else None


def _keyed(
    run: Run,
    uri: str,
    experiment: str,
    tags: dict,
    parent_run_id: str | None = None,
    take_over: bool = False,
) -> KeyedRun:
    if run.info.status == FINISHED:
        return KeyedRun(None, run.info.run_id, FINISHED, dict(run.data.metrics))
    if run.info.status == RUNNING and not is_mine(run) and not take_over:
        state = lease_state(run)
        if state.alive:  # another execution is training it right now: not ours to touch
            return KeyedRun(None, run.info.run_id, "BUSY", dict(run.data.metrics), state.why)
    writer = possible_writer(run)
    if writer is not None:
        return _continue_in_new_run(run, uri, experiment, tags, parent_run_id, writer)
    lease = {k: tags[k] for k in LEASE_TAGS if k in tags}
    if (
        TOKEN_TAG in lease
    ):  # two executions resuming it at the same moment: the token left on it holds it
        holder = create_once.claim_existing(MlflowClient(uri), run.info.run_id, lease)
        if holder is not None:
            return KeyedRun(None, run.info.run_id, "BUSY", dict(run.data.metrics), holder)
    sink = RunSink.attach(run, uri, experiment)
    old_parent = run.data.tags.get(PARENT_RUN_ID)
    if parent_run_id and old_parent != parent_run_id:
        # A cell begun under another (older or duplicate) parent joins the study's one parent.
        sink.set_tags({PARENT_RUN_ID: parent_run_id, "previous_parent_run_id": old_parent or ""})
    confirm = (
        (lambda: HEARTBEATS.check(run.info.run_id, verify=True)) if TOKEN_TAG in lease else None
    )
    return KeyedRun(sink, run.info.run_id, run.info.status, confirm=confirm)


def _continue_in_new_run(
    old: Run, uri: str, experiment: str, tags: dict, parent_run_id: str | None, writer: str
) -> KeyedRun:
    """Close ``old`` as superseded and give the cell a fresh run with the same key.

    The old holder may still be alive (paused, cut off): fenced by the token, it stops at
    its next check, but a point it was already uploading would land in the run it holds.
    That run is no longer the cell's: its late writes cannot duplicate a step of the new
    run, which fills its earlier epochs from the checkpoint's history on resume.
    """
    client = MlflowClient(uri)
    old_id, token = old.info.run_id, tags.get(TOKEN_TAG, "superseded")
    new_tags = {RUN_KEY: old.data.tags.get(RUN_KEY, ""), **tags, CONTINUES_TAG: old_id}
    # Fence first (a new token on the old run), then open the new run: the old holder's
    # next check fails whatever happens after this line.
    # Tags through log_batch: a reaper may write the same new key at the same moment, and
    # MLflow retries a lost insert there (a single set_tag would fail with a server error).
    log_batch(client, old_id, tags=[RunTag(TOKEN_TAG, token)])
    sink = RunSink.create(
        experiment,
        new_tags,
        parent_run_id or old.data.tags.get(PARENT_RUN_ID),
        uri=uri,
        experiment_id=old.info.experiment_id,
    )
    confirm = None
    if TOKEN_TAG in tags and not sink.offline:
        # Two executions continuing it at the same moment both fenced it: the token left on
        # the old run says which one continues the cell (``tracking.record.create_once``).
        holder = create_once.holder_after_wait(client, old_id, token)
        if holder is not None:
            create_once.withdraw(client, sink.run_id, "", holder)
            return KeyedRun(None, old_id, "BUSY", dict(old.data.metrics), holder)
        confirm = lambda: create_once.confirm_holder(client, old_id, token)  # noqa: E731
    closed = [RunTag(SUPERSEDED_TAG, sink.run_id)]
    if old.info.status == RUNNING:
        closed.append(
            RunTag(
                REASON_TAG,
                f"taken over while its holder may still be alive ({writer}); "
                f"the cell continues in run {sink.run_id}"[:500],
            )
        )
    log_batch(client, old_id, tags=closed)
    if old.info.status == RUNNING:
        client.set_terminated(old_id, "KILLED")
    return KeyedRun(
        sink, sink.run_id, old.info.status, continues=f"{old_id} ({writer})", confirm=confirm
    )


def withdraw_candidate(sink: RunSink, lost: create_once.ClaimLost) -> None:
    """Take back a cell's run that lost its claim before training (``create_once.withdraw``)."""
    with contextlib.suppress(
        Exception
    ):  # a server gone now: the reaper ends it once its lease expires
        create_once.withdraw(MlflowClient(sink.uri), sink.run_id, lost.winner, str(lost))


def open_leased_run(
    experiment: str,
    key: str,
    tags: dict,
    parent_run_id: str | None = None,
    *,
    take_over: bool = False,
) -> KeyedRun:
    """``open_keyed_run`` under a new lease of this execution, held from now on.

    The lease tags go into a new run's first tags; a run this execution continues gets them
    written over the old holder's (which fences it off at its next check); either way the
    heartbeat renews them until ``end_held_run``. A FINISHED or BUSY run comes back as found,
    held by nobody here.
    """
    token = new_token()
    opened = open_keyed_run(
        experiment, key, {**tags, **lease_tags(token)}, parent_run_id, take_over
    )
    opened.token = token
    if opened.sink is None:
        return opened
    if opened.status is not None:
        # this execution holds the run now; an older holder is fenced off
        opened.sink.set_tags(lease_tags(token))
    HEARTBEATS.hold(opened.sink.run_id, opened.sink.uri, token)
    return opened


def end_held_run(sink: RunSink, token: str, status: str) -> None:
    """End a run this execution holds: the lease released first (``lease.released`` = its token),
    so the next execution may continue the cell in place rather than in a new run."""
    HEARTBEATS.release(sink.run_id)
    sink.set_tags({RELEASED_TAG: token})
    sink.end(status)
