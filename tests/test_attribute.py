"""attribute end to end: two tiny trained cells in a real SQLite MLflow store, every method scored, rerun, report,
evidence rebuilt offline, a checkpoint that fails its reload proof.

Slow tier: it trains (two 1-epoch cells of an 8 px image-folder protocol, the path the smoke
protocol takes with Fashion-MNIST) and draws the report's figures twice.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from data_fixtures import make_image_folder
from mlflow.tracking import MlflowClient
from rebuild_checks import forbid_store, number_differences, without_rebuilt_line

from reports.build import build_from_evidence, build_report
from studies.ablation.ablate import open_protocol, run_protocol
from studies.attribution.attribute import open_attribution_protocol, run_attribution_protocol
from studies.runtime.options import StudyOptions
from tracking.kinds import attribution_runs, intervention_runs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ABLATION = """\
name: tiny
description: tiny image-folder protocol for attribution tests
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 2, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 1, batch_size: 8, eval_batch_size: 4}
arms:
  - {name: vit, reference: true}
seeds: [0, 1]
"""
ATTRIBUTION = """\
name: {name}
description: every attribution method on the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
attribution: {{split: val, images: 6, batch_size: 4, norm_threshold: 2.0, examples: 2}}
"""
METHODS = ["cls_attention", "rollout", "chefer", "grad_x_input", "random"]


def _use_store(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.setenv("WORKBENCH_CACHE_DIR", str(tmp / "cache"))
    mp.delenv("MLFLOW_RUN_ID", raising=False)
    mp.chdir(tmp)
    mlflow.set_tracking_uri(uri)


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory, empty_mlflow_db):
    """Two 1-epoch ViT cells of an image-folder protocol, finished in a store shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("attribute")
    shutil.copyfile(empty_mlflow_db, tmp / "mlflow.db")
    folder = tmp / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    (tmp / "tiny.yaml").write_text(ABLATION)
    with pytest.MonkeyPatch.context() as mp:
        _use_store(mp, tmp)
        protocol = open_protocol(str(tmp / "tiny.yaml"), allow_dirty=True)
        outcomes = run_protocol(
            protocol,
            tmp / "tiny.yaml",
            StudyOptions(
                output_dir=tmp / "out", device="cpu", data_path=str(folder), allow_dirty=True
            ),
        )
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    return tmp, folder, protocol


@pytest.fixture
def trained(trained_store, monkeypatch):
    _use_store(monkeypatch, trained_store[0])
    return trained_store


def write_attribution(tmp: Path, protocol, name: str = "tiny_faithfulness") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(ATTRIBUTION.format(name=name, hash=protocol.hash))
    return path


def attribute(tmp: Path, folder: Path, path: Path):
    protocol = open_attribution_protocol(str(path), allow_dirty=True)
    return protocol, run_attribution_protocol(
        protocol,
        path,
        StudyOptions(
            output_dir=tmp / "attr", device="cpu", data_path=str(folder), allow_dirty=True
        ),
    )


def cell_runs(experiment: str):
    client = MlflowClient()
    return client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], "tags.cell = 'true'"
    )


def test_attribute_logs_every_method_a_rerun_computes_nothing_and_the_report_rebuilds_offline(
    trained, monkeypatch
):
    tmp, folder, ablation = trained
    path = write_attribution(tmp, ablation)
    protocol, outcomes = attribute(tmp, folder, path)
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    assert "reload proof: reproduced 6 saved predictions" in outcomes[0].message
    client = MlflowClient()
    sources = {(r.data.tags["arm"], r.data.tags["seed"]): r for r in cell_runs("tiny")}
    cells = cell_runs("tiny_faithfulness")
    assert len(cells) == 2 and len({r.data.tags["mlflow.parentRunId"] for r in cells}) == 1
    parent = client.get_run(cells[0].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.tags["attribution"] == "true"
    for cell in cells:
        source = sources[(cell.data.tags["arm"], cell.data.tags["seed"])]
        assert (
            cell.data.tags["source_run_id"] == source.info.run_id and cell.info.status == "FINISHED"
        )
        assert (
            cell.data.params["code_fingerprint"] == attribution_runs.attribution_code_fingerprint()
        )
        m = cell.data.metrics
        # All 6 validation images are scored: the intact model is the trained cell's best checkpoint, exactly.
        assert m["intact_accuracy"] == source.data.metrics["best_val_accuracy"], (
            m["intact_accuracy"],
        )
        assert m["reload_proof_passed"] == 1.0 and m["reload_proof_max_abs_diff"] == 0.0
        assert m["images"] == 6 and m["patches"] == 4
        for method in METHODS:
            for key in ("deletion_auc", "insertion_auc"):
                assert 0.0 <= m[f"{key}/{method}"] <= 1.0, (key, method)
        assert {f"high_norm_fraction/block{b}" for b in (0, 1)} <= set(m)
        local = (
            Path(urlparse(client.get_run(cell.info.run_id).info.artifact_uri).path) / "attribution"
        )
        with np.load(local / "per_image.npz") as z:
            assert set(attribution_runs.PER_IMAGE_KEYS) <= set(z.files)
            saved = pd.read_csv(
                Path(urlparse(source.info.artifact_uri).path) / "predictions" / "val.csv"
            )
            assert np.array_equal(np.sort(z["indices"]), np.sort(saved["index"].to_numpy()))
            assert z["effects"].shape == (6, 4) and z["norms"].shape == (2, 6, 4)
            assert z["example_images"].shape == (2, 3, 8, 8)
            for method in METHODS:
                assert abs(m[f"rho/{method}"] - np.nanmean(z[f"rho/{method}"])) <= 1e-12, method
                history = client.get_metric_history(cell.info.run_id, f"deletion_curve/{method}")
                mean = z[f"deletion_prob/{method}"].mean(axis=0)  # (F,) over counts 0..4
                assert sorted(p.step for p in history) == list(range(5)), history
                worst = max(abs(p.value - mean[p.step]) for p in history)
                assert worst <= 1e-6, f"max |logged - mean curve| {worst:.3g}"
        assert (local / "summary.json").is_file()

    def no_download(*a, **k):
        raise AssertionError("a rerun must not download or score a finished cell")

    monkeypatch.setattr(intervention_runs, "trained_cell", no_download)
    from studies.cli import main

    again = CliRunner().invoke(
        main,
        [
            "attribute",
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(tmp / "attr"),
        ],
    )
    assert again.exit_code == 0, again.output
    assert "cells: 0 run, 2 already finished (skipped), 0 failed" in again.output, again.output
    assert len(cell_runs("tiny_faithfulness")) == 2

    result = build_report(str(path), tmp / "reports", n_resamples=200, evidence=True)
    md = result.markdown.read_text()
    assert (
        md.startswith(f"# Report: tiny_faithfulness@{protocol.short_hash}\n") and "**2 of 2**" in md
    ), md[:600]
    for part in (
        "## Results",
        "## Faithfulness (vit)",
        "### Against the random baseline (vit)",
        "## Deletion and insertion curves (vit)",
        "## Examples (vit)",
        "## Token norms (vit)",
        "## Runs",
        "### Acted-on models",
        "`chefer`",
        "`random` (baseline)",
        "## Does CLS attend to the tokens that matter? (vit)",
    ):
        assert part in md, part
    assert (
        "## Attention concentration per block (vit)" in md
        and "The model has no register tokens." in md
    )
    assert sorted(p.name for p in result.figures) == [
        "concentration_vit.png",
        "curves_vit.png",
        "examples_vit.png",
        "norms_vit_seed0.png",
        "norms_vit_seed1.png",
        "per_class_rho_vit.png",
    ]

    forbid_store(monkeypatch, tmp)
    rebuilt = build_from_evidence(result.folder / "evidence", tmp / "rebuilt")
    b = rebuilt.markdown.read_text()
    compared, diffs = number_differences(md, b)
    assert compared > 50 and not diffs, f"{len(diffs)} places differ: {diffs[:10]}"
    assert without_rebuilt_line(b) == md
    different = [
        p.name
        for p, q in zip(sorted(result.figures), sorted(rebuilt.figures))
        if p.read_bytes() != q.read_bytes()
    ]
    assert not different, f"figures differ: {different}"


CONTROLS = """\
name: {name}
description: every attribution method and every control on the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
attribution:
  methods: [cls_attention, rollout, chefer, grad_x_input, random, intensity, centre, oracle]
  split: val
  images: 6
  batch_size: 4
  norm_threshold: 2.0
  examples: 1
  random_draws: 3
  sanity_check: true
"""


def test_the_controls_are_logged_reported_and_rebuilt_offline(trained, monkeypatch):
    tmp, folder, ablation = trained
    path = tmp / "tiny_controls.yaml"
    path.write_text(CONTROLS.format(name="tiny_controls", hash=ablation.hash))
    protocol, outcomes = attribute(tmp, folder, path)
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    for cell in cell_runs("tiny_controls"):
        p, m = cell.data.params, cell.data.metrics
        assert p["random_draws"] == "3" and p["sanity_check"] == "True", p
        assert m["rho/oracle"] == pytest.approx(1.0, abs=1e-12)
        assert m["sanity_rho_all_random/intensity"] == pytest.approx(1.0, abs=1e-12)
        assert m["random_draws_sd/rho"] > 0 and m["insertion_start_share"] == 1.0
    result = build_report(str(path), tmp / "reports", n_resamples=100, evidence=True)
    md = result.markdown.read_text()
    for part in (
        "## In one line per method",
        "## Methods, named exactly",
        "### Where the insertion curve starts (vit)",
        "### Against 3 random draws per image (vit)",
        "### Method against method (vit)",
        "### Per class (vit)",
        "### Model-randomisation sanity check (vit)",
        "⚠ survives",
        "95% Fisher z",
    ):
        assert part in md, part
    assert any(  # the model-free baseline is flagged by the randomisation check
        line.startswith("| `intensity`") and "⚠ survives" in line for line in md.splitlines()
    )
    assert "### Against the random baseline (vit)" not in md  # the draws replace the one order
    forbid_store(monkeypatch, tmp)
    rebuilt = build_from_evidence(result.folder / "evidence", tmp / "rebuilt_controls")
    assert without_rebuilt_line(rebuilt.markdown.read_text()) == md


def test_a_checkpoint_that_does_not_reproduce_its_predictions_fails_its_cell_only(
    trained, monkeypatch
):
    tmp, folder, ablation = trained
    real = intervention_runs.trained_cell

    def off_by_a_millionth(name, digest, arm, seed, workdir):
        cell = real(name, digest, arm, seed, workdir)
        if seed == 0:  # one saved probability off by one part in a million
            cell.predictions["val"].loc[0, "prob_0"] += np.float32(1e-6)
        return cell

    monkeypatch.setattr(intervention_runs, "trained_cell", off_by_a_millionth)
    _, outcomes = attribute(tmp, folder, write_attribution(tmp, ablation, "tiny_proof"))
    assert [o.status for o in outcomes] == ["failed", "finished"], [o.message for o in outcomes]
    assert "NOT reproduced" in outcomes[0].message and "nothing scored" in outcomes[0].message
    failed = MlflowClient().get_run(outcomes[0].run_id)
    assert failed.info.status == "FAILED" and "intact_accuracy" not in failed.data.metrics


PRETRAINED = """\
name: tiny_timm_faithfulness
description: a randomly initialised reduced timm ViT with a register token, on an image folder
pretrained:
  model: vit_tiny_patch16_224
  weights: random
  seed: 4
  timm_kwargs: {img_size: 16, patch_size: 8, embed_dim: 16, depth: 2, num_heads: 2, num_classes: 5, reg_tokens: 1}
  dataset: image_folder
  val_size: 6
  class_index: {cat: 4, dog: 0, emu: 2}
attribution: {split: val, images: 6, batch_size: 4, norm_threshold: 2.0, examples: 1}
"""


def test_a_pretrained_timm_vit_on_an_image_folder(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    path = tmp_path / "tiny_timm_faithfulness.yaml"
    path.write_text(PRETRAINED)
    _, outcomes = attribute(tmp_path, folder, path)
    assert [o.status for o in outcomes] == ["finished"], [o.message for o in outcomes]
    (cell,) = cell_runs("tiny_timm_faithfulness")
    assert (
        cell.data.tags["arm"] == "pretrained"
        and cell.data.tags["source_identity"] == "random:vit_tiny_patch16_224:seed4"
    )
    assert "reload_proof_passed" not in cell.data.metrics  # no saved predictions to reproduce
    assert (
        cell.data.metrics["patches"] == 4
    )  # 16 px, patch 8; the class and register tokens are never scored
    local = (
        Path(urlparse(MlflowClient().get_run(cell.info.run_id).info.artifact_uri).path)
        / "attribution"
    )
    with np.load(local / "per_image.npz") as z:
        assert set(np.unique(z["labels"])) <= {4, 0, 2}, (
            "labels are the model's output indices of the classes"
        )
        assert int(z["prefix"]) == 2 and z["prefix_norms"].shape == (2, 6, 2)
        on_registers = z[
            "cls_attention_on_registers"
        ]  # (blocks, images): the one register's share of CLS attention
        assert on_registers.shape == (2, 6) and (on_registers > 0).all()
        register_norm = z["prefix_norms"][1, :, 1].mean()
    m = cell.data.metrics
    diff = max(
        abs(m[f"cls_attention_on_registers/block{b}"] - on_registers[b].mean()) for b in range(2)
    )
    assert (
        diff <= 1e-12 and abs(m["register_norm/block1"] - register_norm) <= 1e-9 * register_norm
    ), diff
    md = build_report(str(path), tmp_path / "reports", n_resamples=50).markdown.read_text()
    assert (
        "## Attention concentration per block (pretrained)" in md and "on the 1 register, %" in md
    )
