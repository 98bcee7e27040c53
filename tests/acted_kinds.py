"""End-to-end helpers of the kinds that act on trained models (``test_attribute.py``,
``test_intervene.py``): two tiny trained cells in a real SQLite MLflow store, the kind's command
run on them, and what every such kind's cells are checked for the same way (the acted-on run, the
reload proof, a rerun that skips, a checkpoint that fails its proof, a pretrained timm source).
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

from studies.ablation.ablate import open_protocol, run_protocol
from studies.runtime.options import StudyOptions
from tracking.kinds import intervention_runs

TINY_ABLATION = """\
name: tiny
description: tiny image-folder protocol for {kind} tests
dataset: {{name: image_folder, val_size: 6, split_seed: 3}}
model: {{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 2, heads: 2, mlp_hidden: 32}}
optim: {{lr: 0.003}}
run: {{epochs: 1, batch_size: 8, eval_batch_size: 4}}
arms:
  - {{name: vit, reference: true}}
seeds: [0, 1]
"""
# A randomly initialised reduced timm ViT with a register token, on an image folder whose three
# classes map to outputs 4, 0 and 2 of its five.
PRETRAINED_SOURCE = """\
pretrained:
  model: vit_tiny_patch16_224
  weights: random
  seed: 4
  timm_kwargs: {img_size: 16, patch_size: 8, embed_dim: 16, depth: 2, num_heads: 2, num_classes: 5, reg_tokens: 1}
  dataset: image_folder
  val_size: 6
  class_index: {cat: 4, dog: 0, emu: 2}
"""
PRETRAINED_IDENTITY = "random:vit_tiny_patch16_224:seed4"


def use_store(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    """Point MLflow, the data cache and the working directory at ``tmp``'s store."""
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.setenv("WORKBENCH_CACHE_DIR", str(tmp / "cache"))
    mp.delenv("MLFLOW_RUN_ID", raising=False)
    mp.chdir(tmp)
    mlflow.set_tracking_uri(uri)


def train_tiny_cells(tmp: Path, empty_mlflow_db: Path, kind: str):
    """Two 1-epoch ViT cells of an image-folder protocol, finished in a store in ``tmp``:
    (``tmp``, the image folder, the ablation protocol)."""
    shutil.copyfile(empty_mlflow_db, tmp / "mlflow.db")
    folder = tmp / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    (tmp / "tiny.yaml").write_text(TINY_ABLATION.format(kind=kind))
    with pytest.MonkeyPatch.context() as mp:
        use_store(mp, tmp)
        protocol = open_protocol(str(tmp / "tiny.yaml"), allow_dirty=True)
        outcomes = run_protocol(protocol, tmp / "tiny.yaml", cpu_options(tmp / "out", folder))
    assert_finished(outcomes, 2)
    return tmp, folder, protocol


def tiny_store_fixtures(kind: str):
    """A test module's two fixtures: ``trained_store``, two tiny cells trained once into a store
    shared by the module's tests (``train_tiny_cells``), and ``trained``, each test pointed at it.
    Assign them to those names in the module: ``trained_store, trained = ...``."""

    @pytest.fixture(scope="module")
    def trained_store(tmp_path_factory, empty_mlflow_db):
        return train_tiny_cells(tmp_path_factory.mktemp(kind), empty_mlflow_db, kind)

    @pytest.fixture
    def trained(trained_store, monkeypatch):
        use_store(monkeypatch, trained_store[0])
        return trained_store

    return trained_store, trained


def cpu_options(output_dir: Path, folder: Path) -> StudyOptions:
    """A study on the CPU, reading the image folder, from an uncommitted protocol file."""
    return StudyOptions(
        output_dir=output_dir, device="cpu", data_path=str(folder), allow_dirty=True
    )


def image_folder(tmp_path: Path, monkeypatch) -> Path:
    """An image folder of three classes in ``tmp_path``, its cache there too."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "images"
    make_image_folder(folder, per_class={"train": 8, "test": 2})
    return folder


def write_protocol(tmp: Path, template: str, name: str, acted) -> Path:
    """``<name>.yaml`` in ``tmp``: ``template`` with the name and the acted-on protocol's hash."""
    path = tmp / f"{name}.yaml"
    path.write_text(template.format(name=name, hash=acted.hash))
    return path


def assert_finished(outcomes, cells: int) -> None:
    assert [o.status for o in outcomes] == ["finished"] * cells, [o.message for o in outcomes]


def cell_runs(experiment: str, where: str = "tags.cell = 'true'"):
    client = MlflowClient()
    return client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], filter_string=where
    )


def artifacts(run) -> Path:
    """The local folder of a run's artifacts (the store is a file store in the test's folder)."""
    return Path(urlparse(run.info.artifact_uri).path)


def saved_indices(source) -> np.ndarray:
    """The dataset indices of the trained run's saved validation predictions, sorted."""
    saved = pd.read_csv(artifacts(source) / "predictions" / "val.csv")
    return np.sort(saved["index"].to_numpy())


def checked_cells(experiment: str, flag: str) -> list:
    """(cell run, the trained run it acted on) of each cell of ``experiment``, checked as every
    acting kind's are: under one finished parent flagged ``flag``, each keyed by its trained run
    and finished, its intact model that run's best checkpoint exactly (the same validation
    accuracy), its reload proof passed."""
    sources = {(r.data.tags["arm"], r.data.tags["seed"]): r for r in cell_runs("tiny")}
    cells = cell_runs(experiment)
    assert len(cells) == 2 and len({r.data.tags["mlflow.parentRunId"] for r in cells}) == 1
    parent = MlflowClient().get_run(cells[0].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.tags[flag] == "true"
    pairs = []
    for cell in cells:
        source = sources[(cell.data.tags["arm"], cell.data.tags["seed"])]
        assert (
            cell.data.tags["source_run_id"] == source.info.run_id and cell.info.status == "FINISHED"
        )
        m = cell.data.metrics
        assert m["intact_accuracy"] == source.data.metrics["best_val_accuracy"], (
            m["intact_accuracy"],
        )
        assert m["reload_proof_passed"] == 1.0 and m["reload_proof_max_abs_diff"] == 0.0
        pairs.append((cell, source))
    return pairs


def rerun_skipping(monkeypatch, command: str, path: Path, folder: Path, output_dir: Path):
    """``workbench <command>`` run again as a user runs it, any download of a trained cell
    refused: every finished cell is skipped before anything is read."""

    def no_download(*a, **k):
        raise AssertionError("a rerun must not download or evaluate a finished cell")

    monkeypatch.setattr(intervention_runs, "trained_cell", no_download)
    from studies.cli import main

    arguments = ["--protocol", str(path), "--allow-dirty", "--device", "cpu"]
    arguments += ["--data-path", str(folder), "--output-dir", str(output_dir)]
    result = CliRunner().invoke(main, [command, *arguments])
    assert result.exit_code == 0, result.output
    assert "cells: 0 run, 2 already finished (skipped), 0 failed" in result.output, result.output
    return result


def first_seed_off_by_a_millionth(monkeypatch) -> None:
    """Seed 0's saved validation predictions no longer what its checkpoint predicts: one saved
    probability off by one part in a million."""
    real = intervention_runs.trained_cell

    def off_by_a_millionth(name, digest, arm, seed, workdir):
        cell = real(name, digest, arm, seed, workdir)
        if seed == 0:
            cell.predictions["val"].loc[0, "prob_0"] += np.float32(1e-6)
        return cell

    monkeypatch.setattr(intervention_runs, "trained_cell", off_by_a_millionth)


def assert_first_cell_failed_its_proof(outcomes, not_done: str) -> None:
    """The first cell failed on its reload proof with ``not_done`` said and no metric logged;
    the second finished."""
    assert [o.status for o in outcomes] == ["failed", "finished"], [o.message for o in outcomes]
    assert "NOT reproduced" in outcomes[0].message and not_done in outcomes[0].message
    failed = MlflowClient().get_run(outcomes[0].run_id)
    assert failed.info.status == "FAILED" and "intact_accuracy" not in failed.data.metrics


def run_pretrained(tmp_path: Path, monkeypatch, name: str, text: str, run):
    """The pretrained-source protocol ``text``, written as ``<name>.yaml`` and run by
    ``run(tmp_path, folder, path)`` on an image folder: (the folder, the file, its one cell run),
    the cell checked: the timm model's identity, no reload proof (no saved predictions)."""
    folder = image_folder(tmp_path, monkeypatch)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    _, outcomes = run(tmp_path, folder, path)
    assert_finished(outcomes, 1)
    (cell,) = cell_runs(name)
    assert (
        cell.data.tags["arm"] == "pretrained"
        and cell.data.tags["source_identity"] == PRETRAINED_IDENTITY
    )
    assert "reload_proof_passed" not in cell.data.metrics
    return folder, path, cell
