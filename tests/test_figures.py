"""The figures entry point: study figures from protocol runs in a real MLflow store, and timm mode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from mlflow.tracking import MlflowClient
from PIL import Image

from data_fixtures import make_image_folder
from studies.ablation.train import prepare_data
from studies.runtime.study_protocol import load_protocol
from studies.tools.figures import figures
from tracking.kinds.figure_runs import find_protocol_runs
from workbench.analysis.study import FIGURE_FILES
from workbench.data import TensorLoader
from workbench.models.registry import build_model, model_config
from workbench.train.checkpoint import FORMAT, atomic_torch_save
from workbench.train.evaluate import predict, save_predictions
from workbench.train.loop import config_hash

PROTOCOL = """\
name: {name}
description: tiny image-folder protocol for the figure tests
dataset: {{name: image_folder, val_size: 6, split_seed: 3}}
model: {{name: fmnist_vit, image_size: 16, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 2, heads: 2, mlp_hidden: 32}}
run: {{epochs: 2, batch_size: 8, evaluate_test: true}}
arms:
  - {{name: vit, reference: true}}
  - {{name: cnn, overrides: {{model: {{name: fmnist_cnn, in_channels: 3, num_classes: 3}}}}}}
seeds: [0, 1]
"""

# (width, height) in pixels = figsize * dpi of each figure for this protocol with --examples 3
EXPECTED_SIZES = {
    "01_patches.png": (1100, 600),
    "02_positional_embeddings.png": (900, 800),
    "03_vit_vs_cnn_curves.png": (1100, 750),
    "04_attention_rollout.png": (660, 900),
    "05_cls_tsne.png": (1300, 580),
    "06_attention_heads.png": (660, 900),
    "07_summary.png": (1200, 626),  # grows with the arms: a table line per arm
    "08_confusion_matrices.png": (1080, 1180),
}


def fake_protocol_runs(
    tmp_path: Path, folder: Path, name: str = "tiny", fingerprint: str | None = None
) -> tuple[Path, str]:
    """Cell runs laid out as ablate lays them out, with untrained tiny models; returns (protocol file, parent id)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(PROTOCOL.format(name=name))
    protocol = load_protocol(path)
    client = MlflowClient()
    exp = client.create_experiment(name)
    parent = client.create_run(
        exp,
        tags={
            "parent": "true",
            "protocol_name": name,
            "protocol_hash": protocol.hash,
            "mlflow.runName": f"{name}@{protocol.short_hash}",
        },
    ).info.run_id
    data = None
    for cell in protocol.cells():
        cfg = cell.train_config(device="cpu", data_path=str(folder))
        data = data or prepare_data(cfg.data)
        torch.manual_seed(cell.seed)
        model = build_model(model_config(cfg.model.name, **cfg.model.overrides)).eval()
        run = client.create_run(
            exp,
            tags={
                "cell": "true",
                "protocol_name": name,
                "protocol_hash": protocol.hash,
                "arm": cell.arm,
                "seed": str(cell.seed),
                "is_reference": str(cell.is_reference).lower(),
                "mlflow.parentRunId": parent,
            },
        )
        run_id = run.info.run_id
        client.log_param(run_id, "model.name", cfg.model.name)
        client.log_param(run_id, "data.fingerprint", fingerprint or data.data_fingerprint)
        client.log_param(run_id, "data.split_fingerprint", data.split_fingerprint)
        out = tmp_path / "artifacts" / run_id
        atomic_torch_save(
            {
                "format": FORMAT,
                "config_hash": config_hash(cfg),
                "model": model.state_dict(),
                "epoch": 2,
                "metrics": {},
            },
            out / "best.pt",
        )
        client.log_artifact(run_id, str(out / "best.pt"), "checkpoints")
        for split in ("val", "test"):
            loader = TensorLoader.from_split(
                getattr(data, split),
                batch_size=8,
                norm=data.norm,
                shuffle=False,
                device=torch.device("cpu"),
            )
            save_predictions(predict(model, loader, torch.device("cpu")), out / f"{split}.csv")
            client.log_artifact(run_id, str(out / f"{split}.csv"), "predictions")
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), default=str))
        client.log_artifact(run_id, str(out / "config.json"))
        for epoch in (1, 2):
            for key in ("train_loss", "val_loss", "train_accuracy", "val_accuracy"):
                client.log_metric(run_id, key, 0.1 * epoch + 0.01 * cell.seed, step=epoch)
        client.set_terminated(run_id, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return path, parent


@pytest.fixture
def image_folder(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 6, "test": 2}, size=16)
    return folder


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def test_protocol_figures_are_written_and_logged_to_the_parent_run(tmp_path, image_folder):
    path, parent = fake_protocol_runs(tmp_path, image_folder)
    out = tmp_path / "figs"
    result = CliRunner().invoke(
        figures,
        [
            "--protocol",
            str(path),
            "--data-path",
            str(image_folder),
            "--output-dir",
            str(out),
            "--examples",
            "3",
            "--tsne-points",
            "12",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert (
        "4 finished cell runs" in result.output
        and f"logged 9 files to run {parent}" in result.output
    )
    assert "background-artifact check" in result.output
    assert sorted(p.name for p in out.glob("*.png")) == sorted(FIGURE_FILES.values())
    for name, size in EXPECTED_SIZES.items():
        assert png_size(out / name) == size, name
    logged = {a.path for a in MlflowClient().list_artifacts(parent, "figures")}
    assert logged == {f"figures/{n}" for n in [*FIGURE_FILES.values(), "figures.json"]}
    manifest = json.loads((out / "figures.json").read_text())
    assert set(manifest["figures"]) == set(FIGURE_FILES.values()) and all(
        f["caption"] for f in manifest["figures"].values()
    )
    assert manifest["background_artifact"]["flagged"]["04_attention_rollout.png"]["checked"] == 6
    # a protocol name resolves to the newest parent's hash: the same runs
    by_name = find_protocol_runs("tiny")
    assert by_name.parent_run_id == parent and len(by_name.cells) == 4
    assert [(c.data.tags["arm"], c.data.tags["seed"]) for c in by_name.cells] == [
        ("cnn", "0"),
        ("cnn", "1"),
        ("vit", "0"),
        ("vit", "1"),
    ]


def test_run_ids_and_refusals(tmp_path, image_folder):
    fake_protocol_runs(tmp_path, image_folder, name="wrongdata", fingerprint="0" * 64)
    runs = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name("wrongdata").experiment_id], "tags.cell = 'true'"
    )
    ids = [r.info.run_id for r in runs]
    result = CliRunner().invoke(
        figures,
        [
            "--run-id",
            ids[0],
            "--run-id",
            ids[1],
            "--data-path",
            str(image_folder),
            "--no-log",
            "--output-dir",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code == 1
    assert (
        "data.fingerprint mismatch" in result.output
        and "not the images the models were trained" in result.output
    )
    assert not (tmp_path / "x").exists()
    missing = CliRunner().invoke(figures, ["--protocol", "never_run"])
    assert (
        missing.exit_code == 1
        and "no MLflow experiment of yours holds protocol 'never_run'" in missing.output
    )
    both = CliRunner().invoke(figures, ["--protocol", "x", "--timm-model", "vit_tiny_patch16_224"])
    assert both.exit_code == 2 and "exactly one of" in both.output


def test_timm_vit_through_the_weight_mapping(tmp_path, mlflow_store):
    from safetensors.torch import save_file

    from workbench.convert.timm_weights import load_timm_weights

    weights = tmp_path / "model.safetensors"
    save_file(
        load_timm_weights("vit_tiny_patch16_224", "random", seed=3).model.state_dict(), str(weights)
    )
    image = tmp_path / "photo.png"
    rng = np.random.default_rng(0)
    pixels = np.zeros((200, 300, 3), np.uint8)
    # textured object on a black background
    pixels[60:140, 100:200] = rng.integers(0, 256, (80, 100, 3))
    Image.fromarray(pixels).save(image)
    out = tmp_path / "timm"
    result = CliRunner().invoke(
        figures,
        [
            "--timm-model",
            "vit_tiny_patch16_224",
            "--weights",
            str(weights),
            "--image",
            str(image),
            "--output-dir",
            str(out),
            "--block",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "152 of 152 source tensors used" in result.output and "crop_pct 0.9" in result.output
    sizes = {p.name: png_size(p) for p in out.glob("*.png")}
    assert sizes == {
        "attention_rollout.png": (660, 460),
        "attention_heads.png": (880, 460),
        "patch_grid_photo.png": (1100, 600),
        "positional_embeddings.png": (900, 800),
    }
    exp = MlflowClient().get_experiment_by_name("figures")
    (run,) = MlflowClient().search_runs([exp.experiment_id])
    assert (
        run.data.params["pretrained"] == "True"
        and run.data.params["model"] == "vit_tiny_patch16_224"
    )
    logged = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "figures")}
    assert logged == {f"figures/{n}" for n in [*sizes, "figures.json"]}


@pytest.mark.parametrize("model", ["vit_base_patch16_siglip_224", "vit_small_patch14_reg4_dinov2"])
def test_timm_mode_on_new_families(tmp_path, monkeypatch, mlflow_store, model):
    """SigLIP (attention-pool head, no class token) and DINOv2 with registers, at reduced size."""
    from workbench.convert import timm_weights

    real = timm_weights.load_timm_weights
    monkeypatch.setattr(
        timm_weights,
        "load_timm_weights",
        lambda name, source, seed: real(
            name,
            source,
            seed=seed,
            embed_dim=64,
            depth=2,
            num_heads=2,
            img_size=64 if "siglip" in name else 56,
        ),
    )
    image = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(
        image
    )
    out = tmp_path / "timm"
    result = CliRunner().invoke(
        figures, ["--timm-model", model, "--image", str(image), "--output-dir", str(out)]
    )
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert {"attention_rollout.png", "attention_heads.png"} <= {p.name for p in out.glob("*.png")}
    if "siglip" in model:
        assert "rollout is not drawn" in result.output
    else:
        assert "rollout is not drawn" not in result.output


def test_a_config_masked_by_the_old_redaction_is_named_not_a_traceback(tmp_path, image_folder):
    """Runs logged between 0dcb45c and 6299e84 hold ``"class_token": "***"`` in config.json; int('***') was the error."""
    fake_protocol_runs(tmp_path, image_folder, name="masked")
    client = MlflowClient()
    run = client.search_runs(
        [client.get_experiment_by_name("masked").experiment_id], "tags.arm = 'vit'"
    )[0]
    folder = tmp_path / "masked_config"
    folder.mkdir()
    config = json.loads(
        Path(client.download_artifacts(run.info.run_id, "config.json", str(folder))).read_text()
    )
    config["model"]["overrides"]["class_token"] = "***"
    (folder / "config.json").write_text(json.dumps(config))
    client.log_artifact(run.info.run_id, str(folder / "config.json"))
    result = CliRunner().invoke(
        figures,
        [
            "--run-id",
            run.info.run_id,
            "--data-path",
            str(image_folder),
            "--no-log",
            "--output-dir",
            str(tmp_path / "x"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert (
        "model.overrides.class_token = '***'" in result.output and run.info.run_id in result.output
    ), result.output
