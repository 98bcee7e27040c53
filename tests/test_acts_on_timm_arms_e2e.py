"""intervene and attribute end to end on a timm ViT trained as an arm: two 1-epoch cells of timm's
vit_tiny_patch16_224 (8 px, width 16, depth 2, 2 heads) in a real SQLite MLflow store, read across to the
glass-box ViT, reload-proven first, every intervention and attribution method logged, reruns compute nothing.

Slow tier: it trains (two cells of an 8 px image-folder protocol) and runs both kinds over them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from acted_kinds import use_store
from click.testing import CliRunner
from data_fixtures import make_image_folder
from mlflow.tracking import MlflowClient

from studies.ablation.ablate import open_protocol, run_protocol
from studies.attribution.attribute import open_attribution_protocol, run_attribution_protocol
from studies.cli import main
from studies.interventions.intervene import InterventionStudy, run_intervention_protocol
from studies.runtime.options import StudyOptions
from studies.runtime.study_kind import open_study
from tracking.kinds import intervention_runs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ABLATION = """\
name: tiny_timm
description: a timm ViT arm on an image folder, for the acts_on tests
dataset: {name: image_folder, val_size: 6, split_seed: 3}
model: {name: timm/vit_tiny_patch16_224, num_classes: 3, img_size: 8, patch_size: 4, embed_dim: 16, depth: 2,
        num_heads: 2, mlp_ratio: 2.0}
optim: {lr: 0.003}
run: {epochs: 1, batch_size: 8, eval_batch_size: 4}
arms:
  - {name: timm_vit, reference: true}
seeds: [0, 1]
"""
INTERVENTION = """\
name: tiny_timm_heads
description: every head and branch of the timm ViT cells
acts_on: {{protocol: tiny_timm, hash: {hash}, arms: [timm_vit]}}
interventions: {{heads: all, head_modes: [zero, mean], branches: all, position_embedding: true}}
evaluation: {{batch_size: 4, mean_images: 8}}
"""
ATTRIBUTION = """\
name: tiny_timm_faithfulness
description: every attribution method on the timm ViT cells
acts_on: {{protocol: tiny_timm, hash: {hash}, arms: [timm_vit]}}
attribution: {{split: val, images: 6, batch_size: 4, norm_threshold: 2.0, examples: 2}}
"""


@pytest.fixture(scope="module")
def trained_store(tmp_path_factory, empty_mlflow_db):
    """Two 1-epoch timm ViT cells of an image-folder protocol, finished, each checked against the glass box."""
    tmp = tmp_path_factory.mktemp("timm_acts_on")
    shutil.copyfile(empty_mlflow_db, tmp / "mlflow.db")
    folder = tmp / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    (tmp / "tiny_timm.yaml").write_text(ABLATION)
    with pytest.MonkeyPatch.context() as mp:
        use_store(mp, tmp)
        protocol = open_protocol(str(tmp / "tiny_timm.yaml"), allow_dirty=True)
        outcomes = run_protocol(
            protocol,
            tmp / "tiny_timm.yaml",
            StudyOptions(
                output_dir=tmp / "out", device="cpu", data_path=str(folder), allow_dirty=True
            ),
        )
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    return tmp, folder, protocol


@pytest.fixture
def trained(trained_store, monkeypatch):
    use_store(monkeypatch, trained_store[0])
    return trained_store


def cell_runs(experiment: str):
    client = MlflowClient()
    return client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], "tags.cell = 'true'"
    )


def _check_cells(experiment: str, outcomes) -> None:
    """Each cell reload-proven on the glass-box copy at 0.0, its intact accuracy the trained cell's, exactly."""
    assert [o.status for o in outcomes] == ["finished"] * 2, [o.message for o in outcomes]
    for outcome in outcomes:
        assert (
            "reload proof: reproduced 6 saved predictions (max |prob difference| 0, tolerance 0"
            in outcome.message
        )
    sources = {r.data.tags["seed"]: r for r in cell_runs("tiny_timm")}
    for source in sources.values():  # the run-end check: the trained weights read across at 0.0
        assert source.data.metrics["glassbox_exact"] == 1.0, source.data.metrics
    cells = cell_runs(experiment)
    assert len(cells) == 2
    for cell in cells:
        source = sources[cell.data.tags["seed"]]
        m = cell.data.metrics
        assert (
            cell.data.tags["source_run_id"] == source.info.run_id and cell.info.status == "FINISHED"
        )
        assert m["reload_proof_passed"] == 1.0 and m["reload_proof_max_abs_diff"] == 0.0, m
        assert m["intact_accuracy"] == source.data.metrics["best_val_accuracy"], (
            m["intact_accuracy"],
        )
        assert (
            "timm/vit_tiny_patch16_224 read across to the glass-box ViT by the exact mapping"
            in cell.data.tags["acted_on"]
        ), cell.data.tags["acted_on"]


def _rerun(command: str, path: Path, folder: Path, output: Path) -> str:
    result = CliRunner().invoke(
        main,
        [
            command,
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folder),
            "--output-dir",
            str(output),
        ],
    )
    assert result.exit_code == 0, result.output
    assert (
        result.output.count("[skipped] ") == 2
        and "cells: 0 run, 2 already finished (skipped), 0 failed" in result.output
    ), result.output
    return result.output


def test_intervene_and_attribute_act_on_a_timm_vit_arm_and_reruns_compute_nothing(
    trained, monkeypatch
):
    tmp, folder, ablation = trained
    heads = tmp / "tiny_timm_heads.yaml"
    heads.write_text(INTERVENTION.format(hash=ablation.hash))
    protocol = open_study(InterventionStudy, str(heads), allow_dirty=True)
    outcomes = run_intervention_protocol(
        protocol,
        heads,
        StudyOptions(output_dir=tmp / "iv", device="cpu", data_path=str(folder), allow_dirty=True),
    )
    _check_cells("tiny_timm_heads", outcomes)
    names = [i.name for i in protocol.grid.expand(protocol.model_config("timm_vit"))]
    assert len(names) == 2 * 2 * 2 + 2 * 2 + 1
    for cell in cell_runs("tiny_timm_heads"):
        assert {f"accuracy_change/{n}" for n in names} <= set(cell.data.metrics)

    faithfulness = tmp / "tiny_timm_faithfulness.yaml"
    faithfulness.write_text(ATTRIBUTION.format(hash=ablation.hash))
    attribution = open_attribution_protocol(str(faithfulness), allow_dirty=True)
    outcomes = run_attribution_protocol(
        attribution,
        faithfulness,
        StudyOptions(
            output_dir=tmp / "attr", device="cpu", data_path=str(folder), allow_dirty=True
        ),
    )
    _check_cells("tiny_timm_faithfulness", outcomes)
    for cell in cell_runs("tiny_timm_faithfulness"):
        assert cell.data.metrics["images"] == 6 and cell.data.metrics["patches"] == 4
        assert {f"rho/{m}" for m in attribution.settings.methods} <= set(cell.data.metrics)

    def no_download(*a, **k):
        raise AssertionError("a rerun must not download or evaluate a finished cell")

    monkeypatch.setattr(intervention_runs, "trained_cell", no_download)
    _rerun("intervene", heads, folder, tmp / "iv")
    _rerun("attribute", faithfulness, folder, tmp / "attr")
    assert len(cell_runs("tiny_timm_heads")) == 2 and len(cell_runs("tiny_timm_faithfulness")) == 2
