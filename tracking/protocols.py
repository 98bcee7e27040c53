"""MLflow records of protocol executions: frozen hashes, parent runs, finished cells."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import mlflow
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tracking.runs import configure_tracking, git_state

PROTOCOL_TAGS = ("protocol_name", "protocol_hash", "arm", "seed")


def experiment_id_for(protocol_name: str) -> str:
    """Each protocol has one experiment, named after it, holding all its runs."""
    configure_tracking()
    client = MlflowClient()
    exp = client.get_experiment_by_name(protocol_name)
    return exp.experiment_id if exp else client.create_experiment(protocol_name)


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
    """Create the parent run of one protocol execution and log the protocol itself."""
    client = MlflowClient()
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
    run = client.create_run(experiment_id_for(protocol.name), tags=tags)
    run_id = run.info.run_id
    client.log_artifact(run_id, str(protocol_file), artifact_path="protocol")
    with tempfile.TemporaryDirectory() as tmp:
        canonical = Path(tmp) / "canonical.json"
        canonical.write_text(protocol.canonical_json())
        client.log_artifact(run_id, str(canonical), artifact_path="protocol")
    client.log_param(run_id, "protocol_description", protocol.description[:500])
    if launcher:
        client.set_tag(launcher, "protocol_parent_run_id", run_id)
    return run_id


def end_parent_run(run_id: str, counts: dict[str, int]) -> None:
    client = MlflowClient()
    for status, n in counts.items():
        client.log_metric(run_id, f"cells_{status}", n)
    client.set_terminated(run_id, "FAILED" if counts.get("failed") else "FINISHED")


def log_report_artifact(run_id: str, path: Path, artifact_path: str = "report") -> None:
    mlflow.tracking.MlflowClient().log_artifact(run_id, str(path), artifact_path=artifact_path)
