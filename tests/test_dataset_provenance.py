"""A run's dataset input says where the data really came from: a local path or the download URL."""

from __future__ import annotations

import json
from pathlib import Path

import medmnist
from mlflow.tracking import MlflowClient

from data_fixtures import make_image_folder, make_retinamnist
from synthetic import synthetic_data
from tracking.kinds.dataset_inputs import training_dataset_input
from workbench.data import locate, prepare


def logged_dataset(store: str, data, experiment: str = "provenance"):
    """Log ``data`` as a run's training input in ``store`` and read the dataset back.

    MLflow keeps one dataset record per experiment, name and digest (the first source
    logged wins), so a second copy of the same data goes to an experiment of its own.
    """
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment(experiment))
    client.log_inputs(run.info.run_id, datasets=[training_dataset_input(data)])
    (logged,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    return logged.dataset


def test_a_local_folder_is_a_local_source_with_its_resolved_path(isolated, mlflow_store):
    make_image_folder(Path("folder"), classes=("cat", "dog"), per_class={"train": 6, "test": 2})
    data = prepare("image_folder", path="folder", split_seed=0)
    dataset = logged_dataset(mlflow_store, data)
    assert dataset.source_type == "local", dataset
    assert json.loads(dataset.source) == {"uri": str(Path("folder").resolve())}
    assert dataset.digest == data.data_fingerprint[:36] and dataset.name == "image_folder-split0"


def test_a_download_is_an_http_source_with_the_url_it_came_from(
    isolated, mlflow_store, monkeypatch
):
    monkeypatch.setitem(
        locate.DOWNLOADERS,
        "retinamnist",
        lambda root, size: make_retinamnist(root / "retinamnist.npz"),
    )
    downloaded = prepare("retinamnist", download=True, verify=False)
    dataset = logged_dataset(mlflow_store, downloaded)
    assert dataset.source_type == "http", dataset
    assert json.loads(dataset.source) == {"url": medmnist.INFO["retinamnist"]["url"]}
    # now read from the user cache: a local copy
    again = prepare("retinamnist", download=True, verify=False)
    assert again.resolution.used.kind.startswith("user cache")
    assert logged_dataset(mlflow_store, again, "provenance-cached").source_type == "local"


def test_data_built_in_memory_says_so(mlflow_store):
    dataset = logged_dataset(mlflow_store, synthetic_data(n_train=20, n_val=10, n_test=10))
    assert dataset.source_type == "code" and "synthetic" in dataset.source, dataset
