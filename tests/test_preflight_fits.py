"""Own-data protocols are refused before any run opens (issue 31): one line per problem, naming the key.

A user's image folder with 3 classes, 8 px RGB images, and a protocol that does not fit it
(classes, channels, image size, split sizes, a transfer source's arm or seed): the ablate
command ends with one ``Error`` line naming each protocol key and the value that fixes it,
and the MLflow store holds no run at all. A name is frozen by its first cell that started
training, not by a parent that failed before any cell trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from cli_errors import one_error_problems
from data_fixtures import make_image_folder
from studies.ablation.ablate import open_protocol
from studies.cli import main
from studies.runtime.study_protocol import ProtocolFrozenError
from studies.transfer.transfer_study import check_source_cell
from tracking.record.protocol_runs import STARTED_TAG, experiment_id_for, frozen_hashes
from tracking.store.session import configure_tracking
from workbench.protocol import load_protocol
from workbench.transfer.source_model import SourceError

# Fits the folder: fmnist models at 8 px, 3 channels, 3 classes. Cases replace one piece.
FITS = {
    "model": "{name: fmnist_vit, image_size: 8, patch_size: 4, in_channels: 3, num_classes: 3, dim: 16, depth: 1, "
    "heads: 2, mlp_hidden: 32}",
    "cnn": "{name: fmnist_cnn, in_channels: 3, num_classes: 3}",
    "dataset": "{name: image_folder}",
    "run": "{epochs: 1, batch_size: 4}",
}
PROTOCOL = """\
name: {name}
description: fit checks
dataset: {dataset}
model: {model}
run: {run}
arms:
  - {{name: vit, reference: true}}
  - {{name: cnn, overrides: {{model: {cnn}}}}}
seeds: [0]
"""


@pytest.fixture
def folders(tmp_path, mlflow_store, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    make_image_folder(tmp_path / "rgb", per_class={"train": 6, "val": 2})
    make_image_folder(tmp_path / "noval", per_class={"train": 6})
    grey = tmp_path / "grey"
    make_image_folder(grey, per_class={"train": 6, "val": 2})
    from PIL import Image

    for png in grey.rglob("*.png"):
        Image.open(png).convert("L").save(png)
    return tmp_path


def write(tmp_path: Path, name: str = "fit", **pieces) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(PROTOCOL.format(name=name, **{**FITS, **pieces}))
    return path


def n_runs() -> int:
    client = MlflowClient()
    return len(client.search_runs([e.experiment_id for e in client.search_experiments()]))


CASES = [  # (pieces, folder, every part the one error line must hold)
    (
        {"model": FITS["model"].replace("num_classes: 3", "num_classes: 10")},
        "rgb",
        [
            "fit.yaml: does not fit image folder rgb: 3 classes (cat, dog, emu), 3 channel(s), 8 x 8 px",
            "model.num_classes=10: the data has 3 classes; set num_classes: 3",
        ],
    ),
    (
        {"cnn": "{name: fmnist_cnn}"},
        "rgb",  # the registry's 1 channel and 10 classes
        [
            "arms[1].overrides.model.num_classes=10",
            "arms[1].overrides.model.in_channels=1: the images have 3 channel(s)",
        ],
    ),
    (
        {},
        "grey",
        [
            "model.in_channels=3: the images have 1 channel(s); set in_channels: 1",
            "arms[1].overrides.model.in_channels=3",
        ],
    ),
    (
        {"model": FITS["model"].replace("image_size: 8", "image_size: 16")},
        "rgb",
        ["model.image_size=16: the images are 8 x 8 px", "set image_size: 8"],
    ),
    (
        {"run": "{epochs: 1, batch_size: 64}"},
        "rgb",
        ["run.batch_size 64 is larger than the training split (18 images"],
    ),
    (  # 18 training images in batches of 17: the last holds one image, and resnet10t's batch norm
        # sees one value per channel on an 8 px image (the study CNN's keeps 2 x 2 and trains)
        {
            "cnn": "{name: timm/resnet10t, in_chans: 3, num_classes: 3}, run: {batch_size: 17}",
        },
        "rgb",
        [
            "arms[1] (cnn): arms[1].overrides.run.batch_size=17 leaves 1 image in the last training "
            "batch (18 training images): its batch norm cannot train on one image",
            "use a batch size of 16",
        ],
    ),
    (
        {"dataset": "{name: image_folder, train_size: 10}"},
        "rgb",
        [
            "fit.yaml: dataset: train_size=10: image folder rgb has its own validation split (6 images)"
        ],
    ),
    (
        {"dataset": "{name: image_folder, train_size: 16, val_size: 4}"},
        "noval",
        [
            "fit.yaml: dataset: train_size=16 + val_size=4: more than the 18 images of the training split"
        ],
    ),
]


@pytest.mark.parametrize("pieces, folder, parts", CASES, ids=[c[2][-1][:40] for c in CASES])
def test_a_protocol_that_does_not_fit_its_data_is_refused_before_any_run(
    folders, pieces, folder, parts
):
    path = write(folders, **pieces)
    result = CliRunner().invoke(
        main,
        [
            "ablate",
            "--protocol",
            str(path),
            "--allow-dirty",
            "--device",
            "cpu",
            "--data-path",
            str(folders / folder),
            "--output-dir",
            str(folders / "out"),
        ],
    )
    problems = one_error_problems(result, parts[0])
    error = next((line for line in result.output.splitlines() if line.startswith("Error")), "")
    missing = [p for p in parts if p not in error]
    assert not problems and not missing, (
        f"{problems}; missing {missing} in:\n{result.output[-2000:]}"
    )
    assert n_runs() == 0, "a run was created before the check"


def test_a_fitting_protocol_passes_the_checks_and_a_patch_that_does_not_divide_is_noted(
    folders, monkeypatch
):
    from studies.runtime import study_execution
    from studies.runtime.study_execution import prepare_checked_data

    notes = []
    monkeypatch.setattr(study_execution.tqdm, "write", notes.append)
    protocol = load_protocol(
        write(folders, model=FITS["model"].replace("patch_size: 4", "patch_size: 3"))
    )
    data = prepare_checked_data(protocol, str(folders / "rgb"), download=False)
    assert len(data.class_names) == 3
    assert notes == [
        "note: "
        + str(folders / "fit.yaml")
        + ": patch_size 3 does not divide image_size 8: the last "
        "2 row(s) and 2 column(s) of pixels are never seen"
    ], notes


def test_a_transfer_source_arm_or_seed_its_protocol_lacks_is_named(folders):
    source = load_protocol(write(folders, name="src"))
    with pytest.raises(
        SourceError, match=r"x.yaml: source.weights=.*src.yaml has no arm 'big' \(arms: vit, cnn\)"
    ):
        check_source_cell("x.yaml: source.weights='protocol:src/big/seed0'", source, "big", 0)
    with pytest.raises(SourceError, match=r"src.yaml has no seed 4 \(seeds: 0\)"):
        check_source_cell("--source", source, "vit", 4)
    check_source_cell("--source", source, "cnn", 0)  # exists: nothing raised


def test_the_frozen_check_creates_no_experiment(folders):
    # A study refused after this check (a wrong source pin, missing data) must leave the store as it was.
    configure_tracking()
    client = MlflowClient()
    before = {e.name for e in client.search_experiments()}
    assert frozen_hashes("never_run") == set()
    after = {e.name for e in client.search_experiments()}
    assert after == before, f"experiments created by the check: {sorted(after - before)}"


def test_a_name_is_frozen_by_its_first_started_cell_not_by_a_parent_that_failed_before(folders):
    first = load_protocol(write(folders, name="frz"))
    client = MlflowClient()
    exp = experiment_id_for("frz")
    tags = {"protocol_name": "frz", "protocol_hash": first.hash}
    parent = client.create_run(exp, tags={**tags, "parent": "true"}).info.run_id
    client.set_terminated(parent, "FAILED")
    cell = client.create_run(
        exp, tags={**tags, "cell": "true", "mlflow.parentRunId": parent}
    ).info.run_id
    client.set_terminated(cell, "FAILED")  # failed before training: no metric, no start tag
    assert frozen_hashes("frz") == set()
    changed = write(folders, name="frz", run="{epochs: 2, batch_size: 4}")
    assert open_protocol(str(changed), allow_dirty=True).hash != first.hash  # not frozen: accepted

    client.set_tag(cell, STARTED_TAG, "true")  # that cell had started training after all
    assert frozen_hashes("frz") == {first.hash}
    with pytest.raises(
        ProtocolFrozenError, match=f"already run with hash {first.short_hash}.*started training"
    ):
        open_protocol(str(changed), allow_dirty=True)
