"""Outage tolerance: runs survive a tracking server that is away or dies, and `workbench sync` copies them once.

The server here is a real ``mlflow server`` on 127.0.0.1 with basic-auth, started the way
``workbench server start`` starts it, on a SQLite backend (PostgreSQL: test_remote.py).
"""

from __future__ import annotations

import functools

import pytest

from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.ablation import ablate
from data_fixtures import make_image_folder
from servers import free_port, isolated_tracking, workbench_server  # noqa: F401  (fixture)
from studies.ablation.ablate import open_protocol, run_protocol
from studies.runtime.options import StudyOptions
from studies.ablation.train import train_one
from studies.tools.sync import sync as sync_command
from synthetic import synthetic_data, tiny_config
from tracking.export.offline_sync import sync
from tracking.kinds.training_runs import EPOCH_METRICS
from tracking.record.sink import SYNC_SERVER_RUN, SYNC_SYNCED, RunSink
from tracking.store import health, offline_store
from workbench.train.loop import TrainingObserver

ADMIN = ("admin", "outage-test-Passw0rd")
PROTOCOL = """\
name: outage
description: one arm, two seeds, for the outage test
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 3, batch_size: 8, evaluate_test: true}
arms:
  - {name: vit, reference: true}
seeds: [0, 1]
"""
RUN_FILES = {
    "checkpoints/best.pt",
    "checkpoints/last.pt",
    "config.json",
    "history.json",
    "predictions/test.csv",
    "predictions/val.csv",
}


def snapshot(client: MlflowClient, experiment: str) -> dict:
    """Everything a sync could add, per run name: params, tags, full metric histories, files, models, inputs."""
    exp = client.get_experiment_by_name(experiment)
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        rid = run.info.run_id
        history = {
            k: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(rid, k))
            for k in run.data.metrics
        }
        files = set()
        stack = [None]
        while stack:
            for info in client.list_artifacts(rid, stack.pop()):
                (stack.append(info.path) if info.is_dir else files.add(info.path))
        models = [
            m.status
            for m in client.search_logged_models(
                [exp.experiment_id], filter_string=f"source_run_id = '{rid}'"
            )
        ]
        inputs = sorted(d.dataset.digest for d in run.inputs.dataset_inputs)
        key = run.data.tags["mlflow.runName"]
        assert key not in out, f"two server runs named {key}"
        out[key] = dict(
            id=rid,
            status=run.info.status,
            params=run.data.params,
            tags=run.data.tags,
            metrics=history,
            files=files,
            models=[str(m) for m in models],
            inputs=inputs,
        )
    return out


def assert_steps_once(metrics: dict, epochs: int) -> None:
    """Every metric holds each step once; the epoch metrics hold every epoch (step 0: end-of-run values)."""
    for key, points in metrics.items():
        steps = [p[0] for p in points]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {points}"
        if key in EPOCH_METRICS:
            assert [s for s in steps if s > 0] == list(range(1, epochs + 1)), f"{key}: {points}"


@pytest.mark.slow  # 5 to 7 s: the default tier reached 4 min 59 s on a fresh clone (docs/testing.md)
def test_unreachable_at_start_logs_locally_and_sync_copies_once(
    isolated_tracking, tmp_path, monkeypatch
):
    # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    parent = RunSink.create("q", {"mlflow.runName": "parent", "parent": "true"})
    assert parent.offline
    outcome = train_one(
        tiny_config(epochs=2, evaluate_test=True),
        synthetic_data(n_train=64, n_val=32, n_test=32),
        experiment="q",
        output_dir=tmp_path / "out",
        run_name="child",
        parent_run_id=parent.run_id,
    )
    assert outcome.status == "finished" and outcome.offline, outcome.message
    assert "workbench sync" in outcome.message
    parent.log_metrics({"cells_finished": 1})
    parent.end("FINISHED")

    local = snapshot(MlflowClient(offline_store.fallback_uri()), "q")
    # sync works into any store; the server case is below
    target = f"sqlite:///{tmp_path / 'target.db'}"
    report = sync(offline_store.fallback_uri(), target)
    assert (report.runs_created, report.models, report.errors) == (2, 1, []), report.summary()
    copied = snapshot(MlflowClient(target), "q")
    assert copied["child"]["tags"]["mlflow.parentRunId"] == copied["parent"]["id"]
    for name in ("parent", "child"):
        for field in ("status", "params", "metrics", "files", "inputs", "models"):
            assert copied[name][field] == local[name][field], f"{name}.{field}"
    assert copied["child"]["files"] == RUN_FILES
    assert_steps_once(copied["child"]["metrics"], epochs=2)

    again = sync(offline_store.fallback_uri(), target)
    assert (again.runs_created, again.runs_skipped) == (0, 2), again.summary()
    rechecked = sync(offline_store.fallback_uri(), target, recheck=True)
    assert (
        rechecked.runs_created,
        rechecked.metric_points,
        rechecked.artifacts,
        rechecked.models,
        rechecked.params,
    ) == (0, 0, 0, 0, 0), rechecked.summary()
    assert snapshot(MlflowClient(target), "q") == copied


class KillServerAfterEpoch(TrainingObserver):
    """Kills the server right after the first cell's epoch ``epoch`` was logged to it (deterministic)."""

    def __init__(self, server, epoch: int) -> None:
        self.server, self.epoch, self.killed_in = server, epoch, None

    def on_epoch(self, metrics: dict) -> None:
        if self.killed_in is None and metrics["epoch"] == self.epoch:
            self.server.kill()
            self.killed_in = metrics["epoch"]


@pytest.mark.integration
@pytest.mark.slow  # a long kill test with servers: slow tier (the default tier keeps test_train's SIGKILL resume)
def test_server_killed_mid_run_then_sync_holds_everything_exactly_once(
    isolated_tracking, tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 14, "test": 4})
    protocol_file = tmp_path / "outage.yaml"
    protocol_file.write_text(PROTOCOL)
    with workbench_server(
        f"sqlite:///{tmp_path / 'server.db'}",
        tmp_path / "artifacts",
        ADMIN,
        auth_db=f"sqlite:///{tmp_path / 'auth.db'}",
    ) as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
        killer = KillServerAfterEpoch(server, epoch=1)
        monkeypatch.setattr(ablate, "train_one", functools.partial(train_one, observer=killer))
        protocol = open_protocol(str(protocol_file), allow_dirty=True)
        outcomes = run_protocol(
            protocol,
            protocol_file,
            StudyOptions(
                output_dir=tmp_path / "out", device="cpu", data_path=str(folder), allow_dirty=True
            ),
        )
        assert killer.killed_in == 1
        assert [o.status for o in outcomes] == ["finished", "finished"], [
            o.message for o in outcomes
        ]
        err = capsys.readouterr().err
        assert f"tracking server {server.url} unreachable" in err and "workbench sync" in err

        # Locally: a mirror of the killed cell's server run, the second cell whole, the parent's end.
        local = MlflowClient(offline_store.fallback_uri())
        runs = local.search_runs([local.get_experiment_by_name("outage").experiment_id])
        by_name = {r.data.tags["mlflow.runName"]: r for r in runs}
        assert set(by_name) == {"vit-seed0", "vit-seed1", f"outage@{protocol.short_hash}"}
        mirror = by_name["vit-seed0"]
        assert mirror.data.tags[SYNC_SERVER_RUN] == outcomes[0].run_id
        assert [m.step for m in local.get_metric_history(mirror.info.run_id, "val_accuracy")] == [
            1,
            2,
            3,
        ]
        assert SYNC_SERVER_RUN not in by_name["vit-seed1"].data.tags

        server.start()  # same port, backend store and artifact store
        offline_store.forget_health()
        result = CliRunner().invoke(sync_command, [], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert "runs: 1 created, 2 updated" in result.output, result.output

        client = MlflowClient(server.url)
        state = snapshot(client, "outage")
        parent = state[f"outage@{protocol.short_hash}"]
        assert parent["status"] == "FINISHED" and parent["metrics"]["cells_finished"][0][2] == 2
        assert len(parent["metrics"]["cells_finished"]) == 1
        # one record per execution
        executions = {f for f in parent["files"] if f.startswith("executions/")}
        assert len(executions) == 1 and parent["files"] - executions == {
            "protocol/outage.yaml",
            "protocol/canonical.json",
        }
        assert state["vit-seed0"]["id"] == outcomes[0].run_id, (
            "the killed cell was merged into its own server run"
        )
        for name in ("vit-seed0", "vit-seed1"):
            cell = state[name]
            assert (
                cell["status"] == "FINISHED" and cell["tags"]["mlflow.parentRunId"] == parent["id"]
            ), name
            assert_steps_once(cell["metrics"], epochs=3)
            assert cell["files"] == RUN_FILES, name
            assert cell["models"] == ["READY"] and len(cell["inputs"]) == 1, name
            on_disk = [
                p
                for p in (tmp_path / "artifacts").rglob("*")
                if p.is_file() and cell["id"] in p.parts
            ]
            assert len(on_disk) == len(RUN_FILES), f"{name}: {len(on_disk)} artifact files stored"
        for run in local.search_runs([local.get_experiment_by_name("outage").experiment_id]):
            assert run.data.tags[SYNC_SYNCED] in {s["id"] for s in state.values()}

        # A second sync (also re-comparing runs already marked synced) adds nothing.
        again = CliRunner().invoke(sync_command, ["--recheck"], catch_exceptions=False)
        assert again.exit_code == 0 and "runs: 0 created, 0 updated, 3 unchanged" in again.output, (
            again.output
        )
        assert "added 0 metric points, 0 params, 0 artifact files, 0 models" in again.output, (
            again.output
        )
        assert snapshot(client, "outage") == state
        for value in [
            v for s in state.values() for v in (*s["params"].values(), *s["tags"].values())
        ]:
            assert ADMIN[1] not in value, "a credential was logged"


@pytest.mark.integration
@pytest.mark.slow  # a server stopped and started again around two executions: 50 s
def test_a_study_begun_offline_keeps_its_one_parent_when_the_server_is_back(
    isolated_tracking, tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 3})
    protocol_file = tmp_path / "outage.yaml"
    protocol_file.write_text(PROTOCOL.replace("epochs: 3", "epochs: 1"))
    with workbench_server(
        f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts", None
    ) as server:
        server.kill()  # away when the study starts
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        offline_store.forget_health()
        protocol = open_protocol(str(protocol_file), allow_dirty=True)
        run = functools.partial(
            run_protocol,
            protocol,
            protocol_file,
            StudyOptions(
                output_dir=tmp_path / "out", device="cpu", data_path=str(folder), allow_dirty=True
            ),
        )
        real, calls = ablate.train_one, []

        def ctrl_c_after_the_first_cell(*args, **kwargs):
            if calls:
                raise KeyboardInterrupt
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(ablate, "train_one", ctrl_c_after_the_first_cell)
        with pytest.raises(KeyboardInterrupt):
            run()
        monkeypatch.setattr(ablate, "train_one", real)
        server.start()
        offline_store.forget_health()
        capsys.readouterr()
        assert [o.status for o in run()] == ["skipped", "finished"]
        out = capsys.readouterr().out
        assert (
            "is in the local fallback store (logged while the server was away): continuing there"
            in out
        ), out

        local = MlflowClient(offline_store.fallback_uri())
        exp = local.get_experiment_by_name("outage")
        (parent,) = local.search_runs([exp.experiment_id], "tags.parent = 'true'")
        cells = local.search_runs([exp.experiment_id], "tags.cell = 'true'")
        assert parent.info.status == "FINISHED" and len(cells) == 2
        assert {c.data.tags["mlflow.parentRunId"] for c in cells} == {parent.info.run_id}
        server_exp = MlflowClient(server.url).get_experiment_by_name("outage")
        assert server_exp is None or not MlflowClient(server.url).search_runs(
            [server_exp.experiment_id]
        )

        result = CliRunner().invoke(sync_command, [], catch_exceptions=False)
        assert result.exit_code == 0 and "runs: 3 created" in result.output, result.output
        state = snapshot(MlflowClient(server.url), "outage")
        parents = [s for s in state.values() if s["tags"].get("parent") == "true"]
        assert len(parents) == 1 and parents[0]["status"] == "FINISHED", list(state)
        assert {state[n]["tags"]["mlflow.parentRunId"] for n in ("vit-seed0", "vit-seed1")} == {
            parents[0]["id"]
        }


def test_uploads_retry_with_backoff_on_transient_errors_only(monkeypatch):
    import requests
    from mlflow.exceptions import MlflowException

    sleeps, calls = [], []
    monkeypatch.setattr(health.time, "sleep", sleeps.append)

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise requests.exceptions.ConnectionError("connection reset by peer")
        return "uploaded"

    assert health.with_retries(flaky, "upload big.pt", attempts=5) == "uploaded"
    assert sleeps == [2.0, 4.0]
    calls.clear()

    def refused():
        calls.append(1)
        raise MlflowException(
            "API request to endpoint /x failed with error code 401 != 200. Response body: 'no'"
        )

    with pytest.raises(MlflowException):
        health.with_retries(refused, "upload", attempts=5)
    assert len(calls) == 1, "a refused credential is not retried"


def test_targets_are_normalised_without_credentials(tmp_path, monkeypatch):
    from tracking.export.offline_sync import normalise_target, target_tag

    monkeypatch.chdir(tmp_path)
    assert (
        normalise_target("http://bob:s3cret@MLflow.Example.org:80/") == "http://mlflow.example.org"
    )
    assert (
        normalise_target("https://mlflow.example.org:443/base/")
        == "https://mlflow.example.org/base"
    )
    assert normalise_target("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert normalise_target("sqlite:///x.db") == f"sqlite:///{tmp_path / 'x.db'}"
    assert (
        target_tag("http://bob:pw@h:80", "exp")
        == target_tag("http://h/", "exp")
        != target_tag("http://h", "other")
    )
    assert target_tag("http://h:5000", "exp") != target_tag("http://h:5001", "exp")


def _local_runs(uri: str) -> dict[str, str]:
    """A parent and a finished child with a metric history and a file, in a local store."""
    client = MlflowClient(uri)
    exp = offline_store.ensure_experiment(client, "targets")
    parent = client.create_run(exp, tags={"mlflow.runName": "parent"}).info.run_id
    child = client.create_run(
        exp, tags={"mlflow.runName": "child", "mlflow.parentRunId": parent}
    ).info.run_id
    for step in (1, 2, 3):
        client.log_metric(child, "val_accuracy", 0.1 * step, step=step, timestamp=1000 + step)
    client.log_dict(child, {"a": 1}, "config.json")
    client.set_terminated(child, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return {"parent": parent, "child": child}


def test_synced_is_remembered_per_target_and_dry_run_says_where(
    isolated_tracking, tmp_path, monkeypatch
):
    source = f"sqlite:///{tmp_path / 'local.db'}"
    _local_runs(source)
    wrong, right = tmp_path / "wrong.db", tmp_path / "right.db"
    runner = CliRunner()

    planned = runner.invoke(
        sync_command,
        ["--from", source, "--to", f"sqlite:///{wrong}", "--dry-run"],
        catch_exceptions=False,
    )
    assert planned.exit_code == 0, planned.output
    lines = [line for line in planned.output.splitlines() if "(local " in line]
    assert len(lines) == 2 and all(
        f"sqlite:///{wrong} experiment 'targets': new run in a new experiment" in line
        for line in lines
    ), planned.output
    assert "2 of 2 runs would be copied" in planned.output and not wrong.exists(), (
        "a dry run created the target"
    )

    # The mistake of the issue: a first sync into the wrong store must not hide the runs from the right one.
    first = sync(source, f"sqlite:///{wrong}", log=lambda _: None)
    assert (first.runs_created, first.runs_skipped) == (2, 0), first.summary()
    to_right = sync(source, f"sqlite:///{right}", log=lambda _: None)
    assert (to_right.runs_created, to_right.runs_skipped, to_right.metric_points) == (2, 0, 3), (
        to_right.summary()
    )
    copied = snapshot(MlflowClient(f"sqlite:///{right}"), "targets")
    assert copied["child"]["tags"]["mlflow.parentRunId"] == copied["parent"]["id"]
    assert (
        copied["child"]["files"] == {"config.json"}
        and len(copied["child"]["metrics"]["val_accuracy"]) == 3
    )
    assert not any(k.startswith("sync.to.") for k in copied["child"]["tags"]), (
        "sync records leaked to the server"
    )

    # Each target again (the right one spelled differently): nothing to copy.
    monkeypatch.chdir(tmp_path)
    for target in ("sqlite:///right.db", f"sqlite:///{wrong}"):
        again = sync(source, target, log=lambda _: None)
        assert (again.runs_created, again.runs_updated, again.runs_skipped) == (0, 0, 2), (
            target,
            again.summary(),
        )
    assert snapshot(MlflowClient(f"sqlite:///{right}"), "targets") == copied
    planned = runner.invoke(
        sync_command,
        ["--from", source, "--to", "sqlite:///right.db", "--dry-run"],
        catch_exceptions=False,
    )
    assert (
        planned.output.count("already synced (server run ") == 2 and "0 of 2 runs" in planned.output
    ), planned.output
    local = MlflowClient(source).search_runs(
        [MlflowClient(source).get_experiment_by_name("targets").experiment_id]
    )
    assert all(sum(k.startswith("sync.to.") for k in r.data.tags) == 2 for r in local)
