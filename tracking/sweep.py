"""MLflow side of a sweep: the parent run of one invocation, through a ``RunSink``.

The trials are ordinary training runs (``studies.train.train_one``, each through its own
sink) under this parent. Because the parent logs through a sink too, a tracking server
that dies mid-sweep costs nothing: the parent and the remaining trials continue in the
local fallback store and ``workbench sync`` merges them into the server runs later.
"""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from tracking import ui_links
from tracking.lease import HEARTBEATS, RELEASED_TAG, TOKEN_TAG, lease_tags, new_token
from tracking.runs import configure_tracking, git_state, run_user
from tracking.sink import RunSink


def start_sweep_parent(experiment: str, name: str, tags: dict, params: dict, log=print) -> RunSink:
    """The parent run of one sweep invocation (in the protocol's experiment), holding the search space.

    It holds a lease while the sweep runs: `status`, `report` or an `ablate` of the same
    protocol see a live sweep, and mark its parent KILLED only once the sweep is gone.
    """
    token = new_token()
    tags = {"mlflow.runName": name, "mlflow.user": run_user(), "sweep": name, "sweep_parent": "true", **git_state(),
            **tags, **lease_tags(token)}
    sink = RunSink.create(experiment, tags, uri=configure_tracking())
    HEARTBEATS.hold(sink.run_id, sink.uri, token)
    sink.log_params(params)
    if not sink.offline:
        exp_id = MlflowClient(sink.uri).get_run(sink.run_id).info.experiment_id
        url = ui_links.run_url(sink.uri, exp_id, sink.run_id)  # None for a local store
        if url:
            log(f"MLflow UI (this sweep's parent run): {url}")
    return sink


def end_sweep_parent(sink: RunSink, best: tuple[int, float, dict] | None, states: dict[str, int],
                     status: str = "FINISHED", why: str = "") -> None:
    """The best trial (number, value, params) if any completed, trial counts by state, and the end.

    ``status``: FINISHED, or KILLED (Ctrl-C, SIGTERM) / FAILED with ``why``.
    """
    HEARTBEATS.release(sink.run_id)
    if best is not None:
        number, value, params = best
        sink.log_metrics({"best_val_accuracy": value})
        sink.set_tags({"best_trial": str(number), **{f"best.{field}": str(v) for field, v in params.items()}})
    sink.log_metrics({f"trials_{state}": n for state, n in states.items()})
    sink.set_tags({RELEASED_TAG: sink.journal.tags.get(TOKEN_TAG, ""), **({"end_reason": why[:500]} if why else {})})
    sink.end(status)
