"""The equivalence entry point logs a complete run into a real local MLflow store."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.cli import main


@pytest.mark.slow  # 12-21 s on 2 busy cores: keeps the default tier under 5 minutes (docs/testing.md)
def test_equivalence_run_is_logged_with_metrics_artifacts_and_verdict(mlflow_store, tmp_path):
    result = CliRunner().invoke(
        main, ["equivalence", "--model", "vit_tiny_patch16_224", "--batch", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "PASS vit_tiny_patch16_224" in result.output and "NOT PRETRAINED" in result.output
    assert "all 152 tensors randomised (seed 0)" in result.output

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
    expected = {
        "stages.csv",
        "stages.json",
        "gradients.csv",
        "fused_stages.csv",
        "mapping_audit.json",
        "stage_differences.png",
    }
    assert {f"equivalence/{name}" for name in expected} <= artifacts
    local = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="equivalence", dst_path=str(tmp_path / "dl")
    )
    stages = pd.read_csv(f"{local}/stages.csv")
    assert len(stages) == 100 and stages.passed.all()
    assert len(json.loads(open(f"{local}/stages.json").read())) == 100


def test_failing_equivalence_exits_nonzero_and_tags_fail(mlflow_store, monkeypatch):
    from workbench import equivalence

    real = equivalence.glassbox_from_timm

    def perturbed(model):
        glass, audit = real(model)
        with torch.no_grad():
            glass.head.bias.add_(1e-3)  # a difference only at the last stage
        return glass, audit

    monkeypatch.setattr(equivalence, "glassbox_from_timm", perturbed)
    result = CliRunner().invoke(
        main, ["equivalence", "--model", "vit_tiny_patch16_224", "--batch", "1", "--no-gradients"]
    )
    assert result.exit_code == 1, result.output
    assert "FAIL vit_tiny_patch16_224" in result.output and "99 of 100 stages" in result.output
    (run,) = MlflowClient(mlflow_store).search_runs(
        [MlflowClient(mlflow_store).get_experiment_by_name("equivalence").experiment_id]
    )
    assert run.data.tags["verdict"] == "fail"


def test_cli_accepts_a_timm_vit_outside_the_old_whitelist(mlflow_store, monkeypatch):
    """vit_small_patch16_384 was refused by name before; any timm ViT architecture is accepted now.
    Built at reduced width/depth (same options) to stay fast; the full-size run is in the slow tier."""
    from workbench.convert import timm_weights

    real = timm_weights.load_timm_weights
    monkeypatch.setattr(
        "studies.tools.equivalence_check.load_timm_weights",
        lambda name, source, seed: real(
            name, source, seed=seed, embed_dim=64, depth=2, num_heads=2
        ),
    )
    result = CliRunner().invoke(
        main, ["equivalence", "--model", "vit_small_patch16_384", "--batch", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "PASS vit_small_patch16_384" in result.output


def reduced_weights(monkeypatch):
    """load_timm_weights at width 64, depth 2 (same options): CLI tests in seconds."""
    from workbench.convert import timm_weights

    real = timm_weights.load_timm_weights
    monkeypatch.setattr(
        "studies.tools.equivalence_check.load_timm_weights",
        lambda name, source, seed: real(
            name, source, seed=seed, embed_dim=64, depth=2, num_heads=2
        ),
    )


def test_no_gradients_still_compares_plain_forward(mlflow_store, monkeypatch):
    from workbench.models.vit import Block

    def forward_with_bug(self, x):
        # the bug: the MLP branch is dropped
        return self.hook_resid2(self.hook_resid1(x + self.attn(self.norm1(x))))

    monkeypatch.setattr(Block, "forward", forward_with_bug)
    reduced_weights(monkeypatch)
    result = CliRunner().invoke(
        main, ["equivalence", "--model", "vit_small_patch16_224", "--batch", "1", "--no-gradients"]
    )
    assert result.exit_code == 1, result.output
    assert (
        "FAIL vit_small_patch16_224" in result.output and "0 of 2 forward() logits" in result.output
    ), result.output


def test_timm_init_is_an_explicit_labelled_choice(mlflow_store, monkeypatch):
    reduced_weights(monkeypatch)
    result = CliRunner().invoke(
        main,
        [
            "equivalence",
            "--model",
            "vit_small_patch16_224",
            "--batch",
            "1",
            "--weights",
            "timm-init",
            "--no-gradients",
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        "timm's own init" in result.output and "2 of 2 forward() logits within 0" in result.output
    )
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("equivalence").experiment_id])
    assert (
        run.data.params["weight_source"] == "timm-init" and run.data.metrics["forward_passed"] == 2
    )


@pytest.mark.slow
def test_cli_full_size_vit_small_384(mlflow_store):
    result = CliRunner().invoke(
        main, ["equivalence", "--model", "vit_small_patch16_384", "--batch", "1"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "model, expected",
    [
        ("vit_tiny_r_s16_p8_224", "HybridEmbed patch embedding"),
        ("deit_tiny_distilled_patch16_224", "distillation token"),
        ("vit_gigantic_banana", "unknown model 'vit_gigantic_banana'"),
    ],
)
def test_unsupported_or_unknown_model_is_one_line_and_nonzero(mlflow_store, model, expected):
    result = CliRunner().invoke(main, ["equivalence", "--model", model, "--batch", "1"])
    assert result.exit_code != 0
    assert expected in result.output and "Traceback" not in result.output, result.output
    # refused before any weights line
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_coverage_mode_prints_and_logs_a_table(mlflow_store, monkeypatch):
    names = [
        ("vit_base_patch16_siglip_224", "vision_transformer"),
        ("vit_tiny_r_s16_p8_224", "vision_transformer_hybrid"),
        ("deit_tiny_distilled_patch16_224", "deit"),
    ]
    monkeypatch.setattr("workbench.equivalence_coverage.coverage_architectures", lambda: names)
    result = CliRunner().invoke(main, ["equivalence", "--all"])
    assert result.exit_code == 0, result.output
    assert "vit_base_patch16_siglip_224" in result.output and "HybridEmbed" in result.output
    assert "total.match=1" in result.output and "total.refused=2" in result.output

    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("equivalence").experiment_id])
    assert run.data.tags["verdict"] == "pass"
    assert (
        run.data.metrics["coverage.total.match"] == 1
        and run.data.metrics["coverage.total.refused"] == 2
    )
    local = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="equivalence/coverage.csv"
    )
    table = pd.read_csv(local)
    assert list(table.verdict) == ["match", "refused", "refused"]
    assert table.max_stage_diff.iloc[0] == 0.0 and table.max_gradient_diff.iloc[0] == 0.0
    assert "pooling=map" in table.family_options.iloc[0]


TRAINED_KWARGS = {
    "img_size": 32,
    "patch_size": 4,
    "embed_dim": 64,
    "depth": 2,
    "num_heads": 4,
    "mlp_ratio": 2.0,
    "num_classes": 10,
}


def test_a_timm_arm_built_with_keyword_arguments_is_checked_with_model_kwargs(
    mlflow_store, tmp_path
):
    """A trained timm arm (here: vit_tiny reduced as smoke_timm_arms builds it) is checked from its
    weights file with the arm's kwargs; without them the misfit is one short line naming the option."""
    import timm
    from safetensors.torch import save_file

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TRAINED_KWARGS)
    weights = tmp_path / "arm.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    base = ["equivalence", "--model", "vit_tiny_patch16_224", "--weights", str(weights)]
    refused = CliRunner().invoke(main, [*base, "--batch", "1"])
    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output[-500:]
    (line,) = [x for x in refused.output.splitlines() if x.startswith("Error")]
    assert len(line) < 500 and "--model-kwargs" in line, f"{len(line)} characters: {line[:600]}"
    result = CliRunner().invoke(
        main, [*base, "--batch", "1", "--model-kwargs", json.dumps(TRAINED_KWARGS)]
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert "PASS vit_tiny_patch16_224" in result.output, result.output[-2000:]
    bad = CliRunner().invoke(main, [*base, "--model-kwargs", "{img_size: 32"])
    assert bad.exit_code == 2 and "--model-kwargs" in bad.output, bad.output
