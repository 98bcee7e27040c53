"""MLflow side of a sweep: its one parent run, through a ``RunSink``, shared by every execution.

The trials are ordinary training runs (``studies.ablation.train.train_one``, each through its own
sink) under this parent. One sweep (protocol hash, arm, Optuna study name and storage,
search space: ``sweep_key``) has one parent: every execution, resumed or started beside
another one on the same storage, finds it and reattaches, as ``ablate`` does with a
study's parent. Executions alive at once share it: each renews a lease tag of its own and
the last one to end closes it. Because the parent logs through a sink, a tracking server
that dies mid-sweep costs nothing: the parent and the remaining trials continue in the
local fallback store and ``workbench sync`` merges them into the server runs later.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tracking.record import create_once
from tracking.record.lease import (
    HEARTBEATS,
    RELEASED_TAG,
    TOKEN_TAG,
    execution_states,
    execution_tag,
    execution_value,
    lease_state,
    lease_tags,
    new_token,
    reap_expired,
)
from tracking.record.protocol_runs import experiment_id_for
from tracking.record.schema import (
    PARENT_RUN_ID,
    RUN_NAME,
    SWEEP,
    SWEEP_PARENT,
    TRUE,
    USER,
    all_of,
    tag_is,
)
from tracking.record.sink import SYNC_SERVER_RUN, RunSink
from tracking.store import ui_links
from tracking.store.offline_store import ensure_experiment, fallback_exists, fallback_uri
from tracking.store.session import configure_tracking, git_state, run_user
from tracking.store.store_lock import store_lock

SWEEP_KEY = "sweep_key"


def sweep_key(protocol_hash: str, arm: str, name: str, storage: str, space: str) -> str:
    """One sweep: its protocol and arm, its Optuna study (name and redacted storage) and its search space."""
    return hashlib.sha256(
        "|".join((protocol_hash, arm, name, storage, space)).encode()
    ).hexdigest()[:24]


@dataclass
class SweepParent:
    """The sweep's parent as this execution holds it: its sink and this execution's own lease tag."""

    sink: RunSink
    execution: str

    @property
    def run_id(self) -> str:
        return self.sink.run_id


def start_sweep_parent(
    experiment: str, name: str, tags: dict, params: dict, key: str, log=print
) -> SweepParent:
    """The sweep's one parent run (in the protocol's experiment), found or created, and held by this execution.

    It holds a lease while the sweep runs: `status`, `report` or an `ablate` of the same
    protocol see a live sweep, and mark its parent KILLED only once every execution is gone.
    """
    own, uri = new_token(), configure_tracking()
    tags = {
        RUN_NAME: name,
        USER: run_user(),
        SWEEP: name,
        SWEEP_PARENT: TRUE,
        SWEEP_KEY: key,
        **git_state(),
        **tags,
    }
    with store_lock(uri):  # two executions starting together on a local store take turns
        client = MlflowClient(uri)
        exp_id = experiment_id_for(experiment)  # this account's record, renamed or not
        reap_expired(client, exp_id, f"tags.{SWEEP_KEY} = '{key}'", log=log)
        sink, token = _find_or_create(client, exp_id, experiment, tags, own, log)
        HEARTBEATS.hold(sink.run_id, sink.uri, token, execution_tag(own))
        sink.log_params(params)
    if not sink.offline:
        url = ui_links.run_url(sink.uri, exp_id, sink.run_id)  # None for a local store
        if url:
            log(f"MLflow UI (this sweep's parent run): {url}")
    return SweepParent(sink, own)


def _parents(client: MlflowClient, exp_id: str, key: str) -> list[Run]:
    return create_once.ordered(
        client.search_runs(
            [exp_id], all_of(tag_is(SWEEP_KEY, key), tag_is(SWEEP_PARENT, TRUE)), max_results=100
        )
    )


def _find_or_create(
    client: MlflowClient, exp_id: str, experiment: str, tags: dict, own: str, log
) -> tuple[RunSink, str]:
    found, token = _parents(client, exp_id, tags[SWEEP_KEY]), new_token()
    if not found:
        sink = RunSink.create(
            experiment,
            {**tags, **lease_tags(token), execution_tag(own): execution_value()},
            uri=client.tracking_uri,
            experiment_id=exp_id,
        )
        first = (
            None
            if sink.offline
            else create_once.resolve_new(
                client, sink.run_id, lambda: _parents(client, exp_id, tags[SWEEP_KEY])
            )
        )
        if first is None or first.info.run_id == sink.run_id:
            return sink, token
        # Another execution made it at the same moment and it sorts first (``tracking.record.create_once``).
        create_once.withdraw(
            client,
            sink.run_id,
            first.info.run_id,
            "another execution created this sweep's parent at the same moment",
        )
        found = [first]
    run = found[0]
    shared = run.info.status == "RUNNING" and lease_state(run).alive and TOKEN_TAG in run.data.tags
    # an earlier end_reason becomes history
    sink = RunSink.attach(run, client.tracking_uri, experiment)
    for key, (state, _) in execution_states(run).items():
        if not state.alive:  # killed executions never removed their own tag
            with contextlib.suppress(Exception):
                client.delete_tag(run.info.run_id, key)
    token = run.data.tags[TOKEN_TAG] if shared else token
    sink.set_tags(
        {
            **{k: v for k, v in tags.items() if k != RUN_NAME},
            **({} if shared else lease_tags(token)),
            execution_tag(own): execution_value(),
            RELEASED_TAG: "",
        }
    )
    if (
        not shared and not sink.offline
    ):  # another execution may reopen it at this moment with its own token
        token = create_once.shared_token(client, run.info.run_id, token)
    log(f"sweep {tags['sweep']}: parent run {run.info.run_id} reattached")
    return sink, token


def best_under(
    parent: SweepParent, completed: list[tuple[int, float, dict, str | None]]
) -> tuple[int, float, dict] | None:
    """The best (number, value, params) among completed trials whose MLflow run is a child of this parent.

    ``completed``: (trial number, value, params, MLflow run id). A trial whose run hangs under
    another parent (an older execution's) is not this sweep's to name.
    """
    sink = parent.sink
    reached = True
    try:
        client = MlflowClient(sink.uri)
        exp_id = client.get_run(sink.run_id).info.experiment_id
        mine = {
            r.info.run_id
            for r in client.search_runs(
                [exp_id], tag_is(PARENT_RUN_ID, sink.run_id), max_results=50000
            )
        }
    except Exception:  # noqa: BLE001 - the server is away: its trials are in the local store
        mine, reached = set(), False
    if (sink.offline or not reached) and fallback_exists():
        # A trial cut off by an outage has a local mirror that names its server run; the
        # parent may not have gone offline itself yet (it wrote nothing since the outage).
        with contextlib.suppress(Exception):
            local = MlflowClient(fallback_uri())
            exp_id = ensure_experiment(local, sink.experiment)
            for parent_id in {sink.run_id, sink.local_run_id}:  # MLflow's filter has no OR
                for run in local.search_runs([exp_id], tag_is(PARENT_RUN_ID, parent_id)):
                    mine |= {run.info.run_id, run.data.tags.get(SYNC_SERVER_RUN)} - {None}
    ours = [c for c in completed if c[3] in mine]
    if not ours:
        return None
    number, value, params, _ = max(ours, key=lambda c: c[1])
    return number, value, params


def end_sweep_parent(
    parent: SweepParent,
    best: tuple[int, float, dict] | None,
    states: dict[str, int],
    status: str = "FINISHED",
    why: str = "",
) -> str:
    """The best trial (number, value, params) if any completed, trial counts by state, and the end; returns the status.

    ``status``: FINISHED, or KILLED (Ctrl-C, SIGTERM) / FAILED with ``why``. While another
    execution still holds the parent, it stays RUNNING: the last one to end closes it.
    """
    sink = parent.sink
    HEARTBEATS.release(sink.run_id)
    others = False
    with contextlib.suppress(Exception):
        store = MlflowClient(fallback_uri() if sink.mirror_id else sink.uri)
        store.delete_tag(sink.local_run_id, execution_tag(parent.execution))
        others = any(
            state.alive for state, _ in execution_states(store.get_run(sink.local_run_id)).values()
        )
    if best is not None:
        number, value, params = best
        sink.log_metrics({"best_val_accuracy": value})
        sink.set_tags(
            {"best_trial": str(number), **{f"best.{field}": str(v) for field, v in params.items()}}
        )
    sink.log_metrics({f"trials_{state}": n for state, n in states.items()})
    if others and status == "FINISHED":
        return "RUNNING"
    sink.set_tags(
        {
            RELEASED_TAG: sink.journal.tags.get(TOKEN_TAG, ""),
            **({"end_reason": why[:500]} if why else {}),
        }
    )
    sink.end(status)
    return status
