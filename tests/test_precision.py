"""CPU precision and threads: bf16 autocast really used on CPU, refused where unsupported, threads recorded."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from studies.ablation.train import train, train_one
from workbench import precision
from synthetic import synthetic_data, tiny_config
from workbench.precision import AmpUnsupported, resolve_amp
from workbench.train.loop import Trainer

needs_bf16 = pytest.mark.skipif(
    not precision.cpu_bf16_supported(), reason="CPU without AVX512-BF16 or AMX"
)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_resolve_amp_off_is_fp32_everywhere():
    assert resolve_amp("off", "cpu") is None


def test_fp16_on_cpu_is_refused_with_the_setting_named():
    with pytest.raises(AmpUnsupported, match=r"run.amp='fp16'.*amp: bf16"):
        resolve_amp("fp16", "cpu")


def test_bf16_on_a_cpu_without_bf16_units_is_refused(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_supported", lambda: False)
    with pytest.raises(AmpUnsupported, match=r"run.amp='bf16'.*no native bf16.*amp: off"):
        resolve_amp("bf16", "cpu")
    # the trainer goes through the same check: no silent fp32 (the old behaviour) or emulated bf16
    with pytest.raises(AmpUnsupported):
        Trainer(tiny_config(epochs=1, amp="bf16"), synthetic_data(64, 32, 10), "unused")


def test_train_cli_refuses_unsupported_amp_in_one_line_and_applies_threads(
    monkeypatch, restore_threads
):
    monkeypatch.setattr(precision, "cpu_bf16_supported", lambda: False)
    result = CliRunner().invoke(train, ["--amp", "bf16", "--device", "cpu", "--threads", "1"])
    assert result.exit_code == 2, result.output
    assert "no native bf16" in result.output and "Traceback" not in result.output, result.output
    assert torch.get_num_threads() == 1, "--threads was not applied"
    result = CliRunner().invoke(train, ["--amp", "fp16", "--device", "cpu"])
    assert result.exit_code == 2 and "GPU setting" in result.output, result.output


@needs_bf16
def test_bf16_autocast_runs_the_training_step_in_bf16_and_the_reload_proof_holds(tmp_path):
    trainer = Trainer(tiny_config(epochs=1, amp="bf16"), synthetic_data(96, 48, 10), tmp_path)
    assert trainer.amp_dtype is torch.bfloat16
    seen = []
    qkv = trainer.model.blocks[0].attn.qkv
    qkv.register_forward_hook(lambda m, i, out: seen.append((m.training, out.dtype)))
    result = trainer.fit()
    train_dtypes = {dtype for training, dtype in seen if training}
    assert train_dtypes == {torch.bfloat16}, f"training-step matmul dtypes: {train_dtypes}"
    # master weights stay fp32 (autocast casts per op, the optimizer updates fp32)
    assert qkv.weight.dtype == torch.float32
    # same kernels, same inputs, same process: the proof stays bitwise at tolerance 0
    proof = result.reload_proof
    assert proof.passed and proof.tolerance == 0.0, proof.summary()


@needs_bf16
def test_train_one_records_capability_precision_and_threads(
    mlflow_store, tmp_path, restore_threads
):
    torch.set_num_threads(1)
    outcome = train_one(
        tiny_config(epochs=1, amp="bf16"),
        synthetic_data(96, 48, 10),
        experiment="p",
        output_dir=tmp_path / "o",
        run_name="tiny",
    )
    assert outcome.status == "finished", outcome.message
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("p").experiment_id])
    params, tags = run.data.params, run.data.tags
    assert params["threads"] == "1" and tags["threads"] == "1"
    assert params["run.amp"] == "bf16" and tags["amp_dtype"] == "bfloat16"
    assert tags["device.bf16_native"] == "true" and tags["device.cpu_capability"]


def test_calibration_measures_rates_and_projects_wall_time():
    from workbench.bench.cells import CellSpeed, measure_arm, project_seconds

    speed = measure_arm("vit", tiny_config(epochs=1), steps=2, warmup=1)
    assert (
        speed.train_images_per_s > 0
        and speed.eval_images_per_s > 0
        and speed.threads == torch.get_num_threads()
    )
    # 3 epochs x (1000 / 100 + 200 / 400) s
    assert abs(project_seconds(CellSpeed("a", 1, 100.0, 400.0, 5), 1000, 200, 3) - 31.5) < 1e-12


def test_ablate_refuses_a_bf16_protocol_on_a_cpu_without_bf16_before_any_cell(
    mlflow_store, tmp_path, monkeypatch
):
    import yaml

    from studies.ablation.ablate import ablate

    protocol = {
        "name": "tiny_bf16",
        "description": "bf16 refusal",
        "dataset": {"name": "fashion_mnist"},
        "model": {"name": "fmnist_vit"},
        "run": {"epochs": 1, "amp": "bf16"},
        "arms": [{"name": "vit", "reference": True}],
        "seeds": [0],
    }
    path = tmp_path / "tiny_bf16.yaml"
    path.write_text(yaml.safe_dump(protocol))
    monkeypatch.setattr(precision, "cpu_bf16_supported", lambda: False)
    result = CliRunner().invoke(
        ablate, ["--protocol", str(path), "--allow-dirty", "--device", "cpu"]
    )
    assert result.exit_code == 2 and "no native bf16" in result.output, result.output
    assert not (tmp_path / "outputs").exists(), "a cell started before the refusal"


@pytest.mark.slow  # about a minute on 2 busy cores (the smoke CNN's batch of 128, eval batch 256)
def test_benchmark_calibrate_prints_the_load_and_a_verdict_per_arm():
    from click.testing import CliRunner

    from studies.benchmarks.calibrate import calibrate

    before = torch.get_num_threads()
    try:
        # fmt: skip
        out = CliRunner().invoke(
            calibrate,
            [
                "--protocol",
                "studies/protocols/smoke.yaml",
                "--arm",
                "cnn",
                "--threads",
                "1",
                "--steps",
                "2",
                "--val-size",
                "64",
            ],
        )
    finally:
        torch.set_num_threads(before)
    assert out.exit_code == 0, out.output
    assert "load average" in out.output and "at the end" in out.output, out.output
    assert "cnn: use: 1 thread(s) (the only option timed)" in out.output, out.output
