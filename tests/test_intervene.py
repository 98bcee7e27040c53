"""intervene end to end: two tiny trained cells in a real SQLite MLflow store, every intervention, rerun, failures."""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

import mlflow
import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from tracking.kinds import intervention_runs
from data_fixtures import make_image_folder
from reports.build import build_report
from studies.ablation.ablate import open_protocol, run_protocol
from studies.cli import main
from studies.interventions.intervene import InterventionStudy, run_intervention_protocol
from studies.runtime.options import StudyOptions
from studies.runtime.study_kind import open_study
from workbench.interventions import InterventionError

pytestmark = pytest.mark.e2e  # a real MLflow store (the module's own, trained once)

ABLATION = """\
name: tiny
description: tiny image-folder protocol for intervention tests
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 2, heads: 2, mlp_hidden: 32}
optim: {lr: 0.003}
run: {epochs: 1, batch_size: 8, eval_batch_size: 4}
arms:
  - {name: vit, reference: true}
seeds: [0, 1]
"""
INTERVENTION = """\
name: {name}
description: every head, branch, the positions, a patch and a set of the tiny cells
acts_on: {{protocol: tiny, hash: {hash}}}
interventions:
  heads: all
  head_modes: [zero, mean]
  branches: all
  position_embedding: true
  patches: [blocks.1.resid2]
  sets: [{{name: first_block, items: [blocks.0.attn.skip, blocks.0.mlp.skip]}}]
evaluation: {{batch_size: 4, mean_images: 8}}
"""


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory, empty_mlflow_db):
    """Two 1-epoch ViT cells of an image-folder protocol, finished in a store shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("intervene")
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


def _use_store(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.setenv("WORKBENCH_CACHE_DIR", str(tmp / "cache"))
    mp.delenv("MLFLOW_RUN_ID", raising=False)
    mp.chdir(tmp)
    mlflow.set_tracking_uri(uri)


@pytest.fixture
def trained(trained_store, monkeypatch):
    _use_store(monkeypatch, trained_store[0])
    return trained_store


def write_intervention(tmp_path: Path, protocol, name: str = "tiny_heads") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(INTERVENTION.format(name=name, hash=protocol.hash))
    return path


def intervene(tmp_path: Path, folder: Path, path: Path):
    protocol = open_study(InterventionStudy, str(path), allow_dirty=True)
    return protocol, run_intervention_protocol(
        protocol,
        path,
        StudyOptions(
            output_dir=tmp_path / "iv", device="cpu", data_path=str(folder), allow_dirty=True
        ),
    )


def runs(experiment: str, where: str = "tags.cell = 'true'"):
    client = MlflowClient()
    return client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], filter_string=where
    )


def test_every_intervention_is_logged_per_cell_and_a_rerun_recomputes_nothing(trained, monkeypatch):
    tmp_path, folder, ablation = trained
    protocol, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation))
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    assert "reload proof: reproduced 6 saved predictions" in outcomes[0].message
    client = MlflowClient()
    sources = {(r.data.tags["arm"], r.data.tags["seed"]): r for r in runs("tiny")}
    cells = runs("tiny_heads")
    assert len(cells) == 2 and len({r.data.tags["mlflow.parentRunId"] for r in cells}) == 1
    parent = client.get_run(cells[0].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.tags["intervention"] == "true"
    names = [i.name for i in protocol.grid.expand(protocol.model_config("vit"))]
    assert len(names) == 2 * 2 * 2 + 2 * 2 + 1 + 1 + 1
    for cell in cells:
        source = sources[(cell.data.tags["arm"], cell.data.tags["seed"])]
        assert (
            cell.data.tags["source_run_id"] == source.info.run_id and cell.info.status == "FINISHED"
        )
        m = cell.data.metrics
        # The intact model on the validation split is the trained cell's best checkpoint: same accuracy, exactly.
        assert m["intact_accuracy"] == source.data.metrics["best_val_accuracy"], (
            m["intact_accuracy"],
        )
        assert m["reload_proof_passed"] == 1.0 and m["reload_proof_max_abs_diff"] == 0.0
        local = (
            Path(urlparse(client.get_run(cell.info.run_id).info.artifact_uri).path)
            / "interventions"
        )
        with np.load(local / "per_example.npz") as z:
            assert [str(n) for n in z["names"]] == names and z["correct"].shape == (len(names), 6)
            assert np.array_equal(z["correct"], z["predicted"] == z["labels"][None, :])
            saved = pd.read_csv(
                Path(urlparse(source.info.artifact_uri).path) / "predictions" / "val.csv"
            )
            assert np.array_equal(np.sort(z["indices"]), np.sort(saved["index"].to_numpy()))
            for k, name in enumerate(names):
                acc = float(z["correct"][k].mean())
                assert abs(m[f"accuracy/{name}"] - acc) <= 1e-12, name
                assert abs(m[f"accuracy_change/{name}"] - (acc - m["intact_accuracy"])) <= 1e-12, (
                    name
                )
            assert 0.0 <= m["source_agreement/blocks.1.resid2.patch"] <= 1.0
            # a patch source is never the example itself
            assert np.all(z["patch_source/blocks.1.resid2.patch"] != np.arange(6))
        with np.load(local / "attention.npz") as z:
            maps = z[
                "maps"
            ]  # (depth, heads, rows, cols): each CLS map over patches sums to at most 1
            assert (
                maps.shape == (2, 2, 2, 2)
                and np.all(maps >= 0)
                and np.all(maps.sum(axis=(2, 3)) <= 1 + 1e-6)
            )

    def no_download(*a, **k):
        raise AssertionError("a rerun must not download or evaluate a finished cell")

    monkeypatch.setattr(intervention_runs, "trained_cell", no_download)
    rerun = CliRunner().invoke(
        main,
        [
            "intervene",
            "--protocol",
            str(write_intervention(tmp_path, ablation)),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(tmp_path / "iv"),
        ],
    )  # the command, as a user runs it
    assert rerun.exit_code == 0, rerun.output
    assert rerun.output.count("[skipped] ") == 2, rerun.output
    assert (
        "cells: 0 run, 2 already finished (skipped), 0 failed\ntime: 0.0 s evaluating interventions"
        in rerun.output
    ), rerun.output
    assert len(runs("tiny_heads")) == 2

    result = build_report(str(tmp_path / "tiny_heads.yaml"), tmp_path / "reports", log=False)
    md = result.markdown.read_text()
    assert md.startswith(f"# Report: tiny_heads@{protocol.short_hash}\n") and "**2 of 2**" in md, (
        md[:600]
    )
    for part in (
        "## Heads (vit)",
        "## Every intervention, ranked (vit)",
        "## Branches, positions and tokens (vit)",
        "## Seed consistency (vit)",
        "## Attention maps beside the effects (vit)",
        "## Runs",
        "`blocks.1.resid2.patch`",
        "`set.first_block`",
        "Zero-ablating one head at a time: ",
    ):
        assert part in md, part
    assert sorted(p.name for p in result.figures) == [
        "attention_vit.png",
        "branches_vit.png",
        "heads_vit.png",
    ]
    table = md[md.index("## Every intervention, ranked (vit)") :]
    first = next(line for line in table.splitlines() if line.replace(" ", "").startswith("|1|"))
    worst = min(
        names, key=lambda n: (np.mean([c.data.metrics[f"accuracy_change/{n}"] for c in cells]), n)
    )
    assert f"`{worst}`" in first, (first, worst)


def test_a_checkpoint_that_does_not_reproduce_its_predictions_fails_its_cell_only(
    trained, monkeypatch
):
    tmp_path, folder, ablation = trained
    client = MlflowClient()
    real = intervention_runs.trained_cell

    def off_by_a_millionth(name, digest, arm, seed, workdir):
        cell = real(name, digest, arm, seed, workdir)
        if seed == 0:  # one saved probability off by one part in a million
            cell.predictions["val"].loc[0, "prob_0"] += np.float32(1e-6)
        return cell

    monkeypatch.setattr(intervention_runs, "trained_cell", off_by_a_millionth)
    _, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation, "tiny_proof"))
    assert [o.status for o in outcomes] == ["failed", "finished"], [o.message for o in outcomes]
    assert "NOT reproduced" in outcomes[0].message and "nothing evaluated" in outcomes[0].message
    failed = client.get_run(outcomes[0].run_id)
    assert failed.info.status == "FAILED" and "intact_accuracy" not in failed.data.metrics


def test_cells_without_a_finished_trained_run_fail_with_what_to_run(
    tmp_path, mlflow_store, monkeypatch
):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    (tmp_path / "tiny.yaml").write_text(ABLATION)
    ablation = open_protocol(str(tmp_path / "tiny.yaml"), allow_dirty=True)
    _, outcomes = intervene(tmp_path, folder, write_intervention(tmp_path, ablation))
    assert [o.status for o in outcomes] == ["failed"] * 2
    assert "no finished cell" in outcomes[0].message and "workbench ablate" in outcomes[0].message


PRETRAINED = """\
name: tiny_timm_heads
description: a randomly initialised reduced timm ViT with a register token, on an image folder
pretrained:
  model: vit_tiny_patch16_224
  weights: random
  seed: 4
  timm_kwargs: {{img_size: 16, patch_size: 8, embed_dim: 16, depth: 2, num_heads: 2, num_classes: 5, reg_tokens: 1}}
  dataset: image_folder
  val_size: 6
  class_index: {{cat: 4, dog: 0, emu: 2}}
interventions:
  heads: all
  head_modes: [zero]
  branches: none
  position_embedding: true
  tokens: [registers]
evaluation: {{batch_size: 4, mean_images: 0}}
"""


def test_a_pretrained_timm_vit_on_an_image_folder(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    path = tmp_path / "tiny_timm_heads.yaml"
    path.write_text(PRETRAINED.format())
    protocol, outcomes = intervene(tmp_path, folder, path)
    assert [o.status for o in outcomes] == ["finished"], [o.message for o in outcomes]
    (cell,) = runs("tiny_timm_heads")
    assert (
        cell.data.tags["arm"] == "pretrained"
        and cell.data.tags["source_identity"] == "random:vit_tiny_patch16_224:seed4"
    )
    assert "reload_proof_passed" not in cell.data.metrics  # no saved predictions to reproduce
    local = (
        Path(urlparse(MlflowClient().get_run(cell.info.run_id).info.artifact_uri).path)
        / "interventions"
    )
    with np.load(local / "per_example.npz") as z:
        assert set(np.unique(z["labels"])) <= {4, 0, 2}, (
            "labels are the model's output indices of the classes"
        )
        assert [str(n) for n in z["names"]] == [
            "blocks.0.attn.head0.zero",
            "blocks.0.attn.head1.zero",
            "blocks.1.attn.head0.zero",
            "blocks.1.attn.head1.zero",
            "pos_embed.zero",
            "tokens.registers.drop",
        ]
    bad = tmp_path / "tiny_timm_bad.yaml"
    bad.write_text(
        PRETRAINED.format()
        .replace("emu: 2", "emu: 7")
        .replace("name: tiny_timm_heads", "name: tiny_timm_bad")
    )
    with pytest.raises(InterventionError, match="class_index.emu=7: the model has only 5 outputs"):
        intervene(tmp_path, folder, bad)


def test_benchmark_intervene_times_the_grid_and_logs_it(trained):
    from click.testing import CliRunner

    from studies.cli import main

    tmp_path, _, ablation = trained
    path = write_intervention(tmp_path, ablation, "tiny_bench")
    result = CliRunner().invoke(
        main, ["benchmark-intervene", "--protocol", str(path), "--examples", "6"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "15 interventions x 2 cells x 6 images" in result.output and "cell 2 of 2:" in result.output
    )
    assert (
        "applies to fmnist_seed_recipe_heads, 5 cells x 800 images, --threads 2: not this configuration"
        in result.output
    )
    (run,) = runs("benchmark-intervene", "tags.benchmark = 'intervene'")
    m = run.data.metrics
    assert (
        m["total_seconds"] > 0 and "goal_met" not in m and run.data.params["interventions"] == "15"
    )
