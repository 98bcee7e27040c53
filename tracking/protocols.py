"""MLflow records of protocol executions: frozen hashes, parent runs, finished cells."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import click
import mlflow
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tracking.offline_fallback import ensure_experiment, fallback_run_exists, fallback_uri, is_unreachable, tracking_uri
from tracking.runs import configure_tracking, git_state
from tracking.sink import RunSink

PROTOCOL_TAGS = ("protocol_name", "protocol_hash", "arm", "seed")


class ProtocolRecordError(click.ClickException):
    """The protocol's runs are spread over several experiments: which record is frozen is ambiguous."""


def experiment_id_for(protocol_name: str) -> str:
    """Each protocol has one experiment holding all its runs, created under the protocol's name.

    It is found by the ``protocol_name`` tag of the runs it holds, not by its name alone:
    an experiment renamed in the UI keeps the protocol's frozen record (recorded hashes,
    finished cells), and the next execution continues it instead of starting a new one.
    """
    configure_tracking()
    client = MlflowClient()
    holding = _experiments_holding(client, protocol_name)
    if len(holding) > 1:
        names = ", ".join(f"{n!r} (id {i})" for i, n in sorted(holding.items()))
        raise ProtocolRecordError(f"runs of protocol {protocol_name!r} are in {len(holding)} experiments: {names}; "
                                  "move them into one (or delete the stray experiment) before running it again")
    if holding:
        return next(iter(holding))
    return ensure_experiment(client, protocol_name)


def _experiments_holding(client: MlflowClient, protocol_name: str) -> dict[str, str]:
    """``{experiment id: name}`` of the active experiments holding a parent run of this protocol."""
    named = client.get_experiment_by_name(protocol_name)
    if named is not None and named.lifecycle_stage == "active" and client.search_runs(
            [named.experiment_id], f"tags.protocol_name = '{protocol_name}'", max_results=1):
        return {named.experiment_id: named.name}  # the usual case, one query; a renamed copy cannot be told apart
    experiments = {e.experiment_id: e.name for e in client.search_experiments(max_results=50000)}
    ids, found = list(experiments), {}
    for i in range(0, len(ids), 100):  # search_runs takes at most 100 experiments at once
        for run in client.search_runs(ids[i:i + 100], f"tags.protocol_name = '{protocol_name}' and tags.parent = 'true'",
                                      max_results=1000):
            found[run.info.experiment_id] = experiments[run.info.experiment_id]
    return found


def recorded_hashes(protocol_name: str) -> set[str]:
    """Every protocol hash this protocol name has been run with."""
    runs = MlflowClient().search_runs(
        [experiment_id_for(protocol_name)], filter_string=f"tags.protocol_name = '{protocol_name}'", max_results=5000
    )
    return {r.data.tags.get("protocol_hash", "") for r in runs} - {""}


def cell_runs(protocol_name: str, protocol_hash: str) -> list[Run]:
    """All cell runs (children) recorded for this protocol hash, any status."""
    return MlflowClient().search_runs(
        [experiment_id_for(protocol_name)],
        filter_string=f"tags.protocol_hash = '{protocol_hash}' and tags.cell = 'true'",
        max_results=50000,
    )


def start_parent_run(protocol, protocol_file: Path, allow_dirty: bool, extra_tags: dict | None = None) -> str:
    """Create the parent run of one protocol execution and log the protocol itself.

    Through a ``RunSink``: with the tracking server away, the parent lives in the local
    fallback store (and its cells beside it) until ``workbench sync``.
    """
    tags = {
        "mlflow.runName": f"{protocol.name}@{protocol.short_hash}",
        "protocol_name": protocol.name,
        "protocol_hash": protocol.hash,
        "protocol_file": str(protocol_file),
        "allow_dirty": str(allow_dirty).lower(),
        "parent": "true",
        **git_state(),
        **(extra_tags or {}),
    }
    launcher = os.environ.get("MLFLOW_RUN_ID")
    if launcher:
        tags["launcher_run_id"] = launcher  # the run `mlflow run` created around this execution
    uri = configure_tracking()
    # Into the protocol's experiment even when it was renamed (the fallback store finds its own by name).
    exp_id = experiment_id_for(protocol.name) if uri != fallback_uri() else None
    sink = RunSink.create(protocol.name, tags, uri=uri, experiment_id=exp_id)
    sink.log_artifact(protocol_file, artifact_path="protocol")
    with tempfile.TemporaryDirectory() as tmp:
        canonical = Path(tmp) / "canonical.json"
        canonical.write_text(protocol.canonical_json())
        sink.log_artifact(canonical, artifact_path="protocol")
    sink.log_params({"protocol_description": protocol.description[:500]})
    if launcher and not sink.offline:
        try:
            MlflowClient().set_tag(launcher, "protocol_parent_run_id", sink.run_id)
        except Exception as err:  # a cross-reference only: never worth stopping the study for
            if not is_unreachable(err):
                raise
    return sink.run_id


def end_parent_run(run_id: str, counts: dict[str, int], experiment: str | None = None) -> None:
    """Cell counts and the final status; a server gone meanwhile gets them through a local mirror."""
    sink = RunSink.for_run(run_id, experiment)
    sink.log_metrics({f"cells_{status}": n for status, n in counts.items()})
    sink.end("FAILED" if counts.get("failed") else "FINISHED")


def parent_status(run_id: str) -> str | None:
    """The parent's status in its store, or None when the server cannot be asked now."""
    uri = fallback_uri() if fallback_run_exists(run_id) else tracking_uri()
    try:
        return MlflowClient(uri).get_run(run_id).info.status
    except Exception as err:
        if is_unreachable(err):
            return None
        raise


def log_report_artifact(run_id: str, path: Path, artifact_path: str = "report") -> None:
    mlflow.tracking.MlflowClient().log_artifact(run_id, str(path), artifact_path=artifact_path)
