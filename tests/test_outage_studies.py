"""Sweeps and transfer studies survive a tracking server killed mid-run, and `workbench sync` copies them once.

The same outage rule as for `ablate` (tests/test_sync.py): a real ``mlflow server`` on
127.0.0.1 is SIGKILLed right after the first trial's / cell's first epoch reached it; the
study goes on in the local fallback store; after a restart, `workbench sync` merges the
cut-off runs into their server runs and adds the rest, and a second sync adds nothing.
"""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.ablation import sweep
from studies.runtime.options import StudyOptions
from studies.runtime.study_kind import open_study
from studies.transfer import transfer_study
from tracking.kinds import transfer_runs
from data_fixtures import make_image_folder, md5
from servers import isolated_tracking, workbench_server  # noqa: F401  (fixture)
from studies.cli import main
from studies.tools.sync import sync as sync_command
from test_ablate import write_protocol
from test_sync import RUN_FILES, assert_steps_once, snapshot
from test_transfer import learnable_retina, one_thread, protocol_dict, regime  # noqa: F401 (autouse fixture)
from test_transfer_study import log_source_run
from tracking.record.sink import SYNC_SERVER_RUN, SYNC_SYNCED
from tracking.store import offline_store, uris
from workbench.data import checksums
from workbench.train.loop import Observers, TrainingObserver

# a long kill test with servers: slow tier (the default tier keeps test_train's SIGKILL resume)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
]


class KillOnce(TrainingObserver):
    """SIGKILLs the server at the first epoch it sees, after the run's own observer logged that epoch."""

    def __init__(self, server) -> None:
        self.server, self.killed_at = server, None

    def on_epoch(self, metrics: dict) -> None:
        if self.killed_at is None:
            self.server.kill()
            self.killed_at = int(metrics["epoch"])


@pytest.fixture
def server(isolated_tracking, tmp_path, monkeypatch):  # noqa: F811
    """A tracking server the test may kill and start again; HTTP retries off so the outage costs seconds."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    with workbench_server(
        f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts", None
    ) as proc:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", proc.url)
        yield proc


def local_runs(experiment: str) -> dict:
    client = MlflowClient(offline_store.fallback_uri())
    exp = client.get_experiment_by_name(experiment)
    return {r.data.tags["mlflow.runName"]: r for r in client.search_runs([exp.experiment_id])}


def sync_twice(server, experiments: tuple[str, ...]) -> dict:
    """Sync, then check a second sync (also re-comparing everything) adds nothing; the server state per experiment."""
    result = CliRunner().invoke(sync_command, [], catch_exceptions=False)
    assert result.exit_code == 0 and "0 errors" in result.output, result.output
    state = {e: snapshot(MlflowClient(server.url), e) for e in experiments}
    for args in ([], ["--recheck"]):
        again = CliRunner().invoke(sync_command, args, catch_exceptions=False)
        assert again.exit_code == 0 and "runs: 0 created, 0 updated" in again.output, again.output
        assert "added 0 metric points, 0 params, 0 artifact files, 0 models" in again.output, (
            again.output
        )
        assert {e: snapshot(MlflowClient(server.url), e) for e in experiments} == state
    for experiment in experiments:
        for run in local_runs(experiment).values():
            assert run.data.tags[SYNC_SYNCED] in {s["id"] for s in state[experiment].values()}, (
                run.data.tags
            )
    return state


def restart(server) -> None:
    server.start()  # same port, backend store and artifact store
    offline_store.forget_health()
    # the study that went offline left MLflow pointing at the local store
    uris.set_process_uri(server.url)


def test_sweep_and_transfer_study_survive_a_server_killed_mid_run(server, tmp_path, monkeypatch):
    """One server for both studies: each start of a real server costs seconds to tens of seconds."""
    sweep_name, sweep_local = run_sweep_killed_mid_trial(server, tmp_path, monkeypatch)
    restart(server)
    protocol, transfer_local = run_transfer_killed_mid_cell(server, tmp_path, monkeypatch)
    restart(server)
    state = sync_twice(server, ("tiny", "tiny_transfer"))
    check_sweep_on_server(state["tiny"], sweep_name, sweep_local)
    check_transfer_on_server(state["tiny_transfer"], protocol, transfer_local, server)


def run_sweep_killed_mid_trial(server, tmp_path, monkeypatch) -> tuple[str, dict]:
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol = write_protocol(tmp_path, epochs=2)
    killer = KillOnce(server)
    train_one = sweep.train_one
    monkeypatch.setattr(
        sweep,
        "train_one",
        lambda *a, observer=None, **kw: train_one(*a, observer=Observers(killer, observer), **kw),
    )
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            "--protocol",
            str(protocol),
            "--param",
            "optim.lr=float:1e-3:1e-2:log",
            "--trials",
            "2",
            "--data-path",
            str(folder),
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert killer.killed_at == 1
    assert "'complete': 2" in result.output and "workbench sync" in result.output, result.output

    # Locally: mirrors of the parent and of the cut-off trial (both began on the server), the second trial whole.
    local = local_runs("tiny")
    name = next(n for n in local if "#" not in n)
    assert set(local) == {name, f"{name}#0", f"{name}#1"}, set(local)
    assert (
        SYNC_SERVER_RUN in local[name].data.tags and SYNC_SERVER_RUN in local[f"{name}#0"].data.tags
    )
    assert SYNC_SERVER_RUN not in local[f"{name}#1"].data.tags
    return name, local


def check_sweep_on_server(state: dict, name: str, local: dict) -> None:
    assert set(state) == set(local)
    parent = state[name]
    assert parent["id"] == local[name].data.tags[SYNC_SERVER_RUN], (
        "the parent was merged into its own server run"
    )
    assert parent["status"] == "FINISHED" and parent["tags"]["best_trial"] in ("0", "1")
    assert [p[0] for p in parent["metrics"]["best_val_accuracy"]] == [0]
    assert parent["params"]["storage"] == "in-memory"
    for trial in (f"{name}#0", f"{name}#1"):
        run = state[trial]
        assert run["status"] == "FINISHED" and run["tags"]["mlflow.parentRunId"] == parent["id"], (
            trial
        )
        assert_steps_once(run["metrics"], epochs=2)
        assert (
            run["files"] == RUN_FILES and run["models"] == ["READY"] and len(run["inputs"]) == 1
        ), trial
    assert state[f"{name}#0"]["id"] == local[f"{name}#0"].data.tags[SYNC_SERVER_RUN]


TRANSFER_FILES = {
    "history.json",
    "test_metrics.json",
    "predictions/val.csv",
    "predictions/test.csv",
    "checkpoints/best.pt",
}


def run_transfer_killed_mid_cell(server, tmp_path, monkeypatch):
    learnable_retina(tmp_path / "retinamnist.npz", counts=(40, 20, 20))
    monkeypatch.setitem(checksums.RETINAMNIST_MD5, 28, md5(tmp_path / "retinamnist.npz"))
    source_run, _ = log_source_run(tmp_path)
    data = protocol_dict(
        source={"weights": f"runs:/{source_run}"},
        seeds=[0],
        run={"batch_size": 16, "eval_batch_size": 64, "log_checkpoints": True},
        evaluation={"n_resamples": 1000},
        regimes=[
            regime("linear", name="linear_probe", reference=True, epochs=2),
            regime("full", name="full_ft", epochs=1),
        ],
    )
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    killer = KillOnce(server)
    select = transfer_study.select_cell
    monkeypatch.setattr(
        transfer_study, "select_cell", lambda *a: select(*a[:-1], Observers(a[-1], killer))
    )
    protocol = open_study(transfer_study.TransferStudy, str(path), allow_dirty=True)
    outcomes = transfer_study.run_transfer(
        protocol,
        path,
        StudyOptions(
            output_dir=tmp_path / "out",
            device="cpu",
            data_path=str(tmp_path / "retinamnist.npz"),
            allow_dirty=True,
        ),
    )
    assert killer.killed_at == 1
    assert [o.status for o in outcomes] == ["finished", "finished"], [o.message for o in outcomes]
    assert all("workbench sync" in o.message for o in outcomes), [o.message for o in outcomes]

    local = local_runs("tiny_transfer")
    parent_name = f"tiny_transfer@{protocol.short_hash}"
    assert set(local) == {parent_name, "linear_probe-seed0", "full_ft-seed0"}, set(local)
    assert (
        SYNC_SERVER_RUN in local["linear_probe-seed0"].data.tags
        and SYNC_SERVER_RUN in local[parent_name].data.tags
    )
    assert SYNC_SERVER_RUN not in local["full_ft-seed0"].data.tags
    return protocol, local


def check_transfer_on_server(state: dict, protocol, local: dict, server) -> None:
    parent_name = f"tiny_transfer@{protocol.short_hash}"
    assert set(state) == set(local)
    parent = state[parent_name]
    assert (
        parent["status"] == "FINISHED"
        and parent["id"] == local[parent_name].data.tags[SYNC_SERVER_RUN]
    )
    assert parent["params"]["data.n_test"] == "20" and [
        p[0] for p in parent["metrics"]["cells_finished"]
    ] == [0]
    assert {"protocol/tiny_transfer.yaml", "protocol/canonical.json"} <= parent["files"]
    for cell, epochs in (("linear_probe-seed0", 2), ("full_ft-seed0", 1)):
        run = state[cell]
        assert run["status"] == "FINISHED" and run["tags"]["mlflow.parentRunId"] == parent["id"], (
            cell
        )
        assert run["tags"]["phase"] == "tested" and run["files"] == TRANSFER_FILES, (
            cell,
            run["files"],
        )
        steps = [p[0] for p in run["metrics"]["val_qwk"]]
        assert steps == list(range(1, epochs + 1)), (cell, run["metrics"]["val_qwk"])
        for key, points in run["metrics"].items():
            assert len({p[0] for p in points}) == len(points), (
                f"{cell}.{key}: a step logged twice: {points}"
            )
    assert (
        state["linear_probe-seed0"]["id"] == local["linear_probe-seed0"].data.tags[SYNC_SERVER_RUN]
    )

    # What sync put on the server is a complete study: the report section builds from it.
    section = transfer_runs.transfer_section("tiny_transfer")
    assert len(section.kappa_table) == 2 and section.kappa_table["logged_equals_file"].all()
