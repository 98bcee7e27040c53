"""Training through MLflow: one run per config, resumed after SIGKILL, everything logged and loadable."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

import mlflow
from studies.ablation.train import train_one
from synthetic import synthetic_data, tiny_config
from test_train import kill_child_mid_epoch, run_child
from workbench.train.checkpoint import load_checkpoint


def only_run(client: MlflowClient, experiment: str):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, f"expected one run, found {len(runs)}"
    return runs[0]


def test_train_one_logs_everything_and_a_second_call_skips(mlflow_store, tmp_path):
    data = synthetic_data()
    cfg = tiny_config(epochs=2, evaluate_test=True)
    outcome = train_one(cfg, data, experiment="t", output_dir=tmp_path / "out", run_name="tiny")
    assert outcome.status == "finished", outcome.message
    client = MlflowClient(mlflow_store)
    run = only_run(client, "t")
    assert run.info.status == "FINISHED"
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert tags["reload_proof"] == "passed" and metrics["reload_proof_passed"] == 1.0
    assert {"device", "torch_version", "timm_version", "git_commit", "git_dirty"} <= set(tags)
    assert params["optim.lr"] == "0.003" and params["model.overrides.dim"] == "32"
    assert params["data.fingerprint"] == data.data_fingerprint
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [m.step for m in history] == [1, 2]
    for key in (
        "train_loss",
        "train_accuracy",
        "val_loss",
        "lr",
        "epoch_seconds",
        "images_per_second",
    ):
        assert len(client.get_metric_history(run.info.run_id, key)) == 2, key
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.digest == data.data_fingerprint[:36]

    paths = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"checkpoints", "predictions", "config.json", "history.json"} <= paths
    local = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, dst_path=str(tmp_path / "dl")
    )
    val = pd.read_csv(f"{local}/predictions/val.csv")
    assert abs((val.label == val.predicted).mean() - metrics["best_val_accuracy"]) < 1e-12
    test = pd.read_csv(f"{local}/predictions/test.csv")
    assert abs((test.label == test.predicted).mean() - metrics["test_accuracy"]) < 1e-12

    # the logged model loads back (offline, no pickled code) and equals the best checkpoint
    from workbench.models.registry import build_model, model_config

    model_uri = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id], output_format="list"
    )[0].model_uri
    loaded = mlflow.pytorch.load_model(model_uri)
    reference = build_model(model_config("fmnist_vit", **cfg.model.overrides))
    reference.load_state_dict(load_checkpoint(f"{local}/checkpoints/best.pt")["model"])
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        diff = (loaded(x) - reference.eval()(x)).abs().max().item()
    assert diff <= 1e-5, f"logged model vs best checkpoint: max |difference| {diff:.3g}"

    again = train_one(cfg, data, experiment="t", output_dir=tmp_path / "out", run_name="tiny")
    assert again.status == "skipped" and again.run_id == outcome.run_id
    only_run(client, "t")


@pytest.mark.slow  # a real SIGKILL of a training child (~15 s); the default tier keeps test_train's
def test_killed_run_resumes_in_the_same_mlflow_run(mlflow_store, tmp_path):
    out = tmp_path / "out"
    kill_child_mid_epoch(out, "mlflow", "k", checkpoint=_first_run_dir(out))
    client = MlflowClient(mlflow_store)
    killed = only_run(client, "k")
    assert killed.info.status == "RUNNING"  # a SIGKILL leaves no chance to close the run
    done = run_child(out, "mlflow", "k")
    assert done.returncode == 0, done.stderr[-3000:]
    run = only_run(client, "k")
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")]
    assert steps == [1, 2, 3, 4], f"each epoch logged exactly once, got steps {steps}"


def _first_run_dir(out):
    """train_one puts checkpoints under OUTPUT/<run key>/; the key is fixed by config and data."""
    from studies.ablation.train import run_key_for

    return (
        out
        / run_key_for(tiny_config(epochs=4, checkpoint_every_steps=3), synthetic_data())
        / "checkpoints"
        / "last.pt"
    )


def test_nan_loss_marks_the_run_failed_with_the_step(mlflow_store, tmp_path, monkeypatch):
    from workbench.train import loop

    real = torch.nn.functional.cross_entropy
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs) * (float("inf") if calls["n"] == 4 else 1.0)

    monkeypatch.setattr(loop, "F", type("F", (), {"cross_entropy": staticmethod(poisoned)}))
    outcome = train_one(
        tiny_config(epochs=2),
        synthetic_data(),
        experiment="n",
        output_dir=tmp_path / "out",
        run_name="nan",
    )
    assert outcome.status == "failed" and "step 3" in outcome.message
    run = only_run(MlflowClient(mlflow_store), "n")
    assert run.info.status == "FAILED"
    assert run.data.tags["nonfinite_loss_step"] == "3"
    assert "inf" in run.data.tags["failure"]


def test_a_dataset_insert_lost_to_another_run_is_linked_on_the_next_try(mlflow_store, monkeypatch):
    """Workers starting cells at once race to insert the same dataset; the loser links it, it does not fail."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput
    from mlflow.exceptions import RestException

    from tracking.record.sink import RunSink

    dataset = MetaDataset(
        source=HTTPDatasetSource(url="file://x/y"), name="images-split3", digest="d" * 36
    )
    inputs = [DatasetInput(dataset._to_mlflow_entity(), [])]
    winner = RunSink.create("race", {"mlflow.runName": "winner"})
    loser = RunSink.create("race", {"mlflow.runName": "loser"})
    real, calls = MlflowClient.log_inputs, []

    def lost_race_once(self, run_id, datasets=None, **kw):
        calls.append(run_id)
        if run_id == loser.run_id and calls.count(run_id) == 1:
            real(self, winner.run_id, datasets=datasets)  # the other run inserts it first ...
            # ... as the server says
            raise RestException(
                {
                    "error_code": "BAD_REQUEST",
                    "message": "(psycopg.errors.UniqueViolation) duplicate "
                    'key value violates unique constraint "dataset_pk"',
                }
            )
        return real(self, run_id, datasets=datasets, **kw)

    monkeypatch.setattr(MlflowClient, "log_inputs", lost_race_once)
    loser.log_inputs(inputs)
    assert calls == [loser.run_id, loser.run_id]
    client = MlflowClient()
    for run in (winner, loser):
        logged = client.get_run(run.run_id).inputs.dataset_inputs
        assert [(d.dataset.name, d.dataset.digest) for d in logged] == [
            ("images-split3", "d" * 36)
        ], run.run_id
    # Any other refusal is an error, not a race: no retry.
    monkeypatch.setattr(
        MlflowClient,
        "log_inputs",
        lambda *a, **k: (_ for _ in ()).throw(
            RestException({"error_code": "BAD_REQUEST", "message": "Dataset name too long"})
        ),
    )
    with pytest.raises(RestException, match="too long"):
        loser.log_inputs(inputs)
