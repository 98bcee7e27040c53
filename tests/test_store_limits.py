"""A store that is full or read-only, and a parent reaped long after it died (issue 31).

- a full artifact store: MLflow's own copy says only ``[Errno 28] No space left on device``;
  the one line names the artifact location and the tracking store, and ``ablate`` stops at
  the first such cell (every later one would train and then fail the same way);
- ``workbench status`` on a store it cannot write: answered without the lock file beside the
  database and without marking anything KILLED (reading needs no lock);
- a parent whose execution died and that a rerun reaps: it ends at its last heartbeat, not
  at the rerun's time, and a rerun that does no cell work keeps that end.

Checked for real (a full and a read-only tmpfs in a private mount namespace) as recorded
in docs/study-record.md; here the file system's answers are simulated where they must be.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from cli_errors import one_error_problems  # noqa: F401 (a fixture)
from studies.cli import main, one_line
from tracking.record.lease import HEARTBEAT_TAG, HOST_TAG, PID_TAG, TOKEN_TAG, last_sign_of_life
from studies.runtime.cell_end import StoreUnwritable
from studies.runtime.options import StudyOptions
from workbench.protocol import load_protocol

PROTOCOLS = Path(__file__).resolve().parents[1] / "studies" / "protocols"


def dead_lease(heartbeat: float) -> dict[str, str]:
    """Lease tags of an execution on another host that stopped renewing at ``heartbeat``."""
    return {
        HOST_TAG: "gone-host",
        PID_TAG: "4242",
        TOKEN_TAG: "t0",
        HEARTBEAT_TAG: f"{heartbeat:.3f}",
    }


def full_artifact_copy(monkeypatch) -> None:
    """The artifact store's disk is full: the copy inside MLflow's local repository fails as it does then."""
    import shutil

    import mlflow.store.artifact.local_artifact_repo as repo

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(repo.shutil, "copyfileobj", enospc)
    # the same module object: MLflow's writes are the ones failing
    assert shutil.copyfileobj is enospc


def test_a_full_artifact_store_is_named_in_one_line(mlflow_store, tmp_path, monkeypatch):
    client = MlflowClient()
    run = client.create_run(client.create_experiment("full")).info.run_id
    (tmp_path / "checkpoint.pt").write_bytes(b"x" * 100)
    full_artifact_copy(monkeypatch)
    with pytest.raises(OSError) as err:
        client.log_artifact(run, str(tmp_path / "checkpoint.pt"))
    # what MLflow says: no file, no store
    assert str(err.value) == "[Errno 28] No space left on device"
    line = one_line(err.value)
    artifacts = client.get_run(run).info.artifact_uri
    assert (
        line.startswith(f"the MLflow artifact store {artifacts} is full: no space left on device")
        and f"the MLflow store {mlflow_store} keeps its run artifacts there" in line
    ), line


def test_ablate_stops_at_the_first_cell_the_full_store_refuses(mlflow_store, tmp_path, monkeypatch):
    from studies.ablation import ablate

    client = MlflowClient()
    run = client.create_run(client.create_experiment("x")).info.run_id
    (tmp_path / "f").write_bytes(b"x")
    full_artifact_copy(monkeypatch)
    calls = []

    def logging_fails(cfg, data, **kw):
        calls.append(kw["run_name"])
        # where a trained cell's checkpoint upload fails
        client.log_artifact(run, str(tmp_path / "f"))

    monkeypatch.setattr(ablate, "train_one", logging_fails)
    protocol = load_protocol(PROTOCOLS / "smoke.yaml")
    with pytest.raises(StoreUnwritable, match=r"^vit/seed0: the MLflow artifact store .* is full"):
        ablate.run_cell(
            protocol,
            protocol.cells()[0],
            data=None,
            parent_run_id="parent",
            options=StudyOptions(output_dir=tmp_path / "out"),
        )
    assert calls == ["vit-seed0"]


def study_store(protocol, heartbeat: float | None = None) -> tuple[MlflowClient, str]:
    """A store holding a study's parent (dead since ``heartbeat``, else FINISHED) and its finished cells."""
    from tracking.record.protocol_runs import study_key
    from workbench.train.fingerprint import current_code_fingerprint

    client = MlflowClient()
    exp = client.create_experiment(protocol.name)
    tags = {"protocol_name": protocol.name, "protocol_hash": protocol.hash}
    parent_tags = {
        **tags,
        "parent": "true",
        "study_key": study_key(protocol),
        "cells_expected": "4",
    }
    parent = client.create_run(
        exp,
        tags={**parent_tags, **(dead_lease(heartbeat) if heartbeat else {})},
        start_time=int((heartbeat or time.time()) * 1000) - 60_000,
    ).info.run_id
    for cell in protocol.cells():
        rid = client.create_run(
            exp,
            tags={
                **tags,
                "cell": "true",
                "arm": cell.arm,
                "seed": str(cell.seed),
                "run_key": cell.key,
                "mlflow.parentRunId": parent,
            },
            start_time=int((heartbeat or time.time()) * 1000) - 50_000,
        ).info.run_id
        client.log_param(rid, "code_fingerprint", current_code_fingerprint())
        client.set_terminated(
            rid, "FINISHED", end_time=int((heartbeat or time.time()) * 1000) - 10_000
        )
    if heartbeat is None:
        client.set_terminated(parent, "FINISHED")
    return client, parent


def test_status_reads_a_store_it_cannot_write_without_a_lock_file(
    mlflow_store, tmp_path, monkeypatch
):
    import filelock

    protocol = load_protocol(PROTOCOLS / "smoke.yaml")
    study_store(protocol)
    store = Path(mlflow_store.removeprefix("sqlite:///"))
    real_access = os.access
    # A read-only mount: no write in the store's folder (root passes chmod, so the answer is simulated).
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode: (
            False if mode & os.W_OK and Path(p) in (store, store.parent) else real_access(p, mode)
        ),
    )

    def no_lock_file(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", f"{store}.lock")

    monkeypatch.setattr(filelock.FileLock, "acquire", no_lock_file)
    from tracking.store import store_lock

    store_lock._READY.clear()  # this process has not opened the store yet, as a fresh `workbench status`
    result = CliRunner().invoke(main, ["status", "--protocol", str(PROTOCOLS / "smoke.yaml")])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "is read-only here" in result.output and "next ablate: skip it x4" in result.output, (
        result.output
    )
    assert not Path(f"{store}.lock").exists()


def test_a_parent_reaped_by_a_rerun_that_skips_everything_ends_at_its_last_heartbeat(mlflow_store):
    from tracking.record.protocol_runs import close_study_parent, open_study_parent

    protocol = load_protocol(PROTOCOLS / "smoke.yaml")
    # killed an hour ago, after its last cell finished (tags keep ms)
    died = round(time.time() - 3600, 3)
    client, parent = study_store(protocol, heartbeat=died)
    died_ms = round(died * 1000)
    assert last_sign_of_life(client.get_run(parent)) == died_ms
    held = open_study_parent(
        protocol, PROTOCOLS / "smoke.yaml", allow_dirty=True, log=lambda line: None
    )
    assert held.run_id == parent and held.previous_end == died_ms, (held.previous_end, died_ms)
    close_study_parent(held, "completed")  # the rerun trained nothing
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.info.end_time == died_ms, (
        run.info.end_time - died_ms,
        "ms after its last heartbeat",
    )


def test_a_run_without_a_lease_is_ended_now_when_reaped(mlflow_store):
    client = MlflowClient()
    run = client.create_run(client.create_experiment("old"))
    assert last_sign_of_life(run) is None  # reap_expired then lets MLflow use the time of the reap
