"""The equivalence entry point logs a complete run into a real local MLflow store."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.cli import main


def test_equivalence_run_is_logged_with_metrics_artifacts_and_verdict(mlflow_store, tmp_path):
    result = CliRunner().invoke(main, ["equivalence", "--model", "vit_tiny_patch16_224", "--batch", "1"])
    assert result.exit_code == 0, result.output
    assert "PASS vit_tiny_patch16_224" in result.output and "NOT PRETRAINED" in result.output

    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("equivalence")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["verdict"] == "pass"
    assert run.data.params["weight_source"] == "random" and run.data.params["pretrained"] == "False"
    assert run.data.params["architecture"] == "vit_tiny_patch16_224"
    assert {"torch_version", "timm_version", "device", "git_commit"} <= set(run.data.tags)
    history = client.get_metric_history(run.info.run_id, "stage_max_abs_diff")
    assert [m.step for m in history] == list(range(100))
    assert max(m.value for m in history) == 0.0
    assert run.data.metrics["stages_passed"] == 100 and run.data.metrics["gradients_passed"] == 152

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "equivalence")}
    expected = {"stages.csv", "stages.json", "gradients.csv", "fused_stages.csv", "mapping_audit.json", "stage_differences.png"}
    assert {f"equivalence/{name}" for name in expected} <= artifacts
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="equivalence", dst_path=str(tmp_path / "dl"))
    stages = pd.read_csv(f"{local}/stages.csv")
    assert len(stages) == 100 and stages.passed.all()
    assert len(json.loads(open(f"{local}/stages.json").read())) == 100


def test_failing_equivalence_exits_nonzero_and_tags_fail(mlflow_store, monkeypatch):
    import workbench.equivalence as eq

    real = eq.glassbox_from_timm

    def perturbed(model):
        glass, audit = real(model)
        with torch.no_grad():
            glass.head.bias.add_(1e-3)  # a difference only at the last stage
        return glass, audit

    monkeypatch.setattr(eq, "glassbox_from_timm", perturbed)
    result = CliRunner().invoke(main, ["equivalence", "--model", "vit_tiny_patch16_224", "--batch", "1", "--no-gradients"])
    assert result.exit_code == 1, result.output
    assert "FAIL vit_tiny_patch16_224" in result.output and "99 of 100 stages" in result.output
    (run,) = MlflowClient(mlflow_store).search_runs(
        [MlflowClient(mlflow_store).get_experiment_by_name("equivalence").experiment_id]
    )
    assert run.data.tags["verdict"] == "fail"
